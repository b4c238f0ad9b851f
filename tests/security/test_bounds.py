"""Input is bounded where it enters (DESIGN §10), tried on the running stack at each door: the admin API,
the ingress, a sidecar's data listener and a worker (with its own key, as the sidecar would call it). Each
malformed input gets a 4xx that names what was wrong; none makes a 5xx, a large reply, or a lasting change;
client errors never count against an instance; gold serves throughout."""

from __future__ import annotations

import json

import pytest

from sie.auth import Identity
from sie.auth.store import CredentialDir
from tests.integration.standalone_helpers import request

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

# The 621-byte shape of the YAML that became a 58 MB reply: nine levels of nine aliases each.
ALIAS_BOMB = (
    "a: &a ["
    + ",".join(["lol"] * 9)
    + "]\n"
    + "".join(f"{chr(98 + i)}: &{chr(98 + i)} [" + ",".join([f"*{chr(97 + i)}"] * 9) + "]\n" for i in range(8))
    + "kind: ModelService\nspec: {model: {name: bomb}, backend: {type: sim}}\n"
)

# Bodies no JSON reader in SIE may accept: (bytes, what the error must be about).
BAD_JSON = [
    (b'{"model": "gold", "text": "x", "deep": ' + b"[" * 100 + b"]" * 100 + b"}", "deep"),
    (b'{"model": "gold", "text": "x", "n": 123456789012345678901234567890}', "integer"),
    (b'{"model": "gold", "text": "\\ud800"}', "surrogate"),
    (b'{"model": "gold", "text": "\xff\xfe"}', "utf-8"),
    (b'{"model": "gold", "text": "x", "temperature": NaN}', "nan"),
    (b'{"model": "gold", "model": "bronze", "text": "x"}', "duplicate"),
]


def _spec(**sla) -> dict:
    return {"kind": "ModelService", "spec": {"model": {"name": "greedy"}, "backend": {"type": "sim"}, "sla": sla}}


@pytest.mark.parametrize(
    "sla, field",
    [
        ({"max_replicas": 1e9}, "spec.sla.max_replicas"),
        ({"max_replicas": 1_000_000_000}, "spec.sla.max_replicas"),
        ({"max_replicas": 2**64}, None),  # beyond 64 bits: the JSON reader refuses it before the spec is read
        ({"p99_latency_ms": 1e300}, "spec.sla.p99_latency_ms"),
        ({"p99_latency_ms": -1}, "spec.sla.p99_latency_ms"),
        ({"max_queue_time_ms": 10**12}, "spec.sla.max_queue_time_ms"),
    ],
)
def test_numeric_spec_fields_are_bounded_by_what_envoy_can_hold(target, sla, field):
    code, _, body = target.stack.request("POST", target.stack.admin + "/v1/models", _spec(**sla))
    assert code == 400, body
    if field is None:
        assert body["error"]["type"] == "invalid_json" and "64-bit" in body["error"]["message"], body
    else:
        assert body["error"]["type"] == "invalid_spec" and field in [p["path"] for p in body["error"]["problems"]], body
    status = target.stack.status()
    assert status["control_plane"]["ready"] and "greedy" not in {m["model_id"] for m in status["models"]}
    target.gold_serves()


@pytest.mark.parametrize("raw", [b'{"spec": {"sla": {"max_replicas": Infinity}}}', b'{"x": 1e999}'])
def test_infinity_never_enters_a_spec(target, raw):
    code, _, body = target.stack.request("POST", target.stack.admin + "/v1/models", raw)
    assert code == 400 and body["error"]["type"] == "invalid_json", body


def test_a_yaml_alias_bomb_is_refused_in_a_small_reply(target):
    assert len(ALIAS_BOMB) < 700
    code, headers, body = request(
        "POST",
        target.stack.admin + "/v1/models",
        ALIAS_BOMB.encode(),
        headers={"content-type": "application/yaml", **target.stack.headers},
    )
    assert code == 400 and body["error"]["type"] == "invalid_yaml" and "alias" in body["error"]["message"]
    assert int(headers["Content-Length"]) < 2048
    assert target.stack.status()["control_plane"]["ready"]


@pytest.mark.parametrize("raw, about", BAD_JSON, ids=[a for _, a in BAD_JSON])
def test_json_that_is_not_plain_json_is_400_at_every_door(target, raw, about):
    gold = target.instance("gold-0")
    worker_key = (target.stack.run_dir / "secrets" / "gold-0.worker-key").read_text().strip()
    doors = [
        ("admin API", target.stack.admin + "/v1/models", target.stack.headers),
        ("ingress", target.envoy + "/generate", {}),
        ("ingress, header-routed", target.envoy + "/generate", {"x-sie-model": "gold"}),
        ("sidecar", f"http://{gold['sidecar_address']}/generate", {}),
        ("worker", f"http://{gold['worker_address']}/generate", {"Authorization": f"Bearer {worker_key}"}),
    ]
    for door, url, headers in doors:
        code, _, body = request("POST", url, raw, headers={"content-type": "application/json", **headers})
        assert code == 400, (door, about, code, body)
        assert isinstance(body, dict) and body["error"]["type"] in ("invalid_json", "invalid_yaml"), (door, body)
    target.gold_serves()


CHAT = [{"role": "user", "content": "x"}]


@pytest.mark.parametrize(
    "path, body, field",
    [
        ("/v1/chat/completions", {"messages": CHAT, "max_tokens": 65}, "max_tokens"),
        ("/v1/chat/completions", {"messages": CHAT, "max_completion_tokens": 10**6}, "max_completion_tokens"),
        ("/v1/completions", {"prompt": "x", "max_tokens": 65}, "max_tokens"),
        ("/generate", {"text": "x", "sampling_params": {"max_new_tokens": 65}}, "sampling_params.max_new_tokens"),
        ("/generate", {"text": "x", "sampling_params": {"max_new_tokens": "lots"}}, "sampling_params.max_new_tokens"),
    ],
)
def test_a_models_token_limit_holds_for_every_spelling(target, path, body, field):
    code, _, answer = request("POST", target.envoy + path, {"model": "gold", **body})
    assert code == 400 and answer["error"]["type"] == "token_limit", answer
    assert answer["error"]["field"] == field, answer


@pytest.mark.parametrize(
    "path, body",
    [
        ("/v1/chat/completions", {"messages": CHAT, "max_tokens": 64}),
        ("/v1/completions", {"prompt": "x", "max_completion_tokens": 64}),
        ("/generate", {"text": "x", "sampling_params": {"max_new_tokens": 64}}),
    ],
)
def test_a_request_within_the_limit_is_served(target, path, body):
    code, _, answer = request("POST", target.envoy + path, {"model": "gold", **body})
    assert code == 200, answer


def test_client_errors_never_count_against_an_instance(target):
    for _ in range(40):
        request(
            "POST",
            target.envoy + "/generate",
            {"model": "gold", "text": "x", "sampling_params": {"max_new_tokens": 999}},
        )
        request(
            "POST",
            target.envoy + "/generate",
            b'{"model": "gold", "text": "\\ud800"}',
            headers={"Content-Type": "application/json"},
        )
    target.gold_serves()
    code, _, body = target.stack.request("GET", target.stack.admin + "/v1/endpoints")
    assert code == 200
    gold = [e for e in body["endpoints"] if e["model_id"] == "gold"]
    assert len(gold) == 2
    for endpoint in gold:
        assert endpoint["record"]["error_rate"] == 0.0, endpoint["record"]
        assert endpoint["in_eds"] and endpoint["decision"]["health"] == "HEALTHY", endpoint


@pytest.mark.parametrize(
    "doc",
    [
        {"spec": {"model": {"name": "x" * 64}, "backend": {"type": "sim"}}},
        {"spec": {"model": {"name": "ok"}, "backend": {"type": "sim"}, "routing": {"inference_paths": ["/-/drain"]}}},
        {
            "spec": {
                "model": {"name": "ok"},
                "backend": {"type": "sim"},
                "routing": {"inference_paths": ["/v1/../-/sleep"]},
            }
        },
        {
            "spec": {
                "model": {"name": "ok"},
                "backend": {"type": "sim"},
                "routing": {"inference_paths": ["/release_memory_occupation"]},
            }
        },
        {"spec": {"model": {"name": "ok"}, "backend": {"type": "sim", "config": {"x" * 300: 1}}}},
        {"spec": {"model": {"name": "ok"}, "backend": {"type": "sim"}, "replicas": 5}},
    ],
)
def test_a_spec_the_ingress_could_not_hold_safely_is_refused_with_the_reason(target, doc):
    code, _, body = target.stack.request("POST", target.stack.admin + "/v1/models", doc)
    assert code == 400 and body["error"]["problems"], body
    assert target.stack.status()["control_plane"]["ready"]
    code, _, models = request("GET", target.envoy + "/v1/models")
    assert {m["id"] for m in models["data"]} == {"gold", "bronze", "scorer"}


def test_an_oversized_admin_body_is_413(target):
    code, _, body = target.stack.request(
        "POST", target.stack.admin + "/v1/models", json.dumps({"spec": {"pad": "x" * (17 << 20)}}).encode()
    )
    assert code == 413 and body["error"]["type"] == "body_too_large", body
    assert target.stack.status()["control_plane"]["ready"]


def test_each_admin_route_reads_only_what_its_contract_holds(target):
    """A sidecar's record is under 1 KB, so 100 KiB of one is refused by its size, unread; a node's beat
    may have megabytes, but no more specs than a node host sends in one (4 MiB, or a single one), nor a
    port that is not ASCII digits."""
    signer = CredentialDir(target.stack.run_dir / "credentials").signer()
    sidecar = {"Authorization": f"Bearer {signer.issue(Identity.for_sidecar('gold-0', 'gold', 'local'))}"}
    code, _, body = request(
        "POST", target.stack.admin + "/v1/telemetry", {"pad": "x" * (100 << 10)}, headers=sidecar, timeout=10
    )
    assert code == 413 and body["error"]["type"] == "body_too_large" and "65536" in body["error"]["message"], body
    node = {"Authorization": f"Bearer {signer.issue(Identity.for_node('probe'))}"}
    report = {"instance_id": "gold-9", "model_id": "gold", "version": "0.0.0", "state": "ready"}
    half = {"pad": "x" * (5 << 19)}  # 2.5 MiB: one fits a beat, two do not
    for reports, path in (
        ([report | {"spec": half}, report | {"instance_id": "gold-8", "spec": half | {"n": 2}}], "instances[1].spec"),
        ([report | {"spec": None, "sidecar_address": "127.0.0.1:\u00b2"}], "instances[0].sidecar_address"),
    ):
        beat = {"node": "probe", "address": "http://127.0.0.1:1", "instances": reports}
        code, _, body = request("POST", target.stack.admin + "/v1/nodes/heartbeat", beat, headers=node, timeout=10)
        assert code == 400 and [p["path"] for p in body["error"]["problems"]] == [path], body
    status = target.stack.status()
    assert status["control_plane"]["ready"] and "probe" not in [n["node"] for n in status["nodes"]]
