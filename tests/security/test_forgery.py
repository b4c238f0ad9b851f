"""Forged telemetry and heartbeats change nothing (DESIGN §10), tried on the running stack by a process that
holds a genuine credential of the wrong kind: a stolen sidecar token (gold-0's) and a node token for a node
that really joined (`evil`, signed by the control plane as `sie join` would have it). EDS only ever holds
the addresses the real node host registered; the genuine reporter keeps reporting; gold keeps serving."""

from __future__ import annotations

import time

import pytest

from sie.auth import Identity
from sie.auth.store import CredentialDir
from tests.integration.standalone_helpers import request, wait_until

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

BAIT = "127.0.0.1:1"  # where an attacker would like gold's prompts to go


def _sidecar_token(target, instance_id: str) -> dict[str, str]:
    token = (target.stack.run_dir / "secrets" / f"{instance_id}.token").read_text().strip()
    return {"Authorization": f"Bearer {token}"}


def _node_token(target, node: str) -> dict[str, str]:
    signer = CredentialDir(target.stack.run_dir / "credentials").signer()
    return {"Authorization": f"Bearer {signer.issue(Identity.for_node(node))}"}


def _record(instance_id: str, **over) -> dict:
    base = {
        "instance_id": instance_id,
        "model_id": "gold",
        "version": "0.0.0",
        "address": BAIT,
        "node": "local",
        "state": "ready",
        "seq": 2**62,
        "timestamp": time.time() + 10**9,
        "reporter": "attacker",
    }
    return base | over


def _eds_addresses(target) -> set[str]:
    """Every endpoint address Envoy holds right now, from its admin /clusters."""
    code, text = target.stack.envoy_admin("/clusters")
    assert code == 200
    out = set()
    for line in str(text).splitlines():
        parts = line.split("::")
        if len(parts) >= 3 and parts[0].startswith("model.") and ":" in parts[1]:
            out.add(parts[1])
    return out


def _registered(target) -> set[str]:
    return {i["sidecar_address"] for i in target.instances() if i.get("sidecar_address")}


def _gold(target) -> dict[str, dict]:
    model = next(m for m in target.stack.status()["models"] if m["model_id"] == "gold")
    return {i["instance_id"]: i for i in model["instances"]}


def test_a_stolen_sidecar_token_reports_only_its_own_instance(target):
    stolen = _sidecar_token(target, "gold-0")
    for claim in ({"instance_id": "gold-1"}, {"model_id": "bronze"}, {"node": "elsewhere"}):
        code, _, answer = request(
            "POST", target.stack.admin + "/v1/telemetry", _record(**{"instance_id": "gold-0"} | claim), headers=stolen
        )
        assert code == 403 and answer["error"]["type"] == "forbidden", (claim, answer)
    target.gold_serves()


def test_a_huge_seq_and_a_future_timestamp_lock_nobody_out_and_name_no_address(target):
    stolen = _sidecar_token(target, "gold-0")
    code, _, answer = request(
        "POST", target.stack.admin + "/v1/telemetry", _record("gold-0", state="draining"), headers=stolen
    )
    assert code == 200, answer
    # The genuine sidecar (another reporter, its own seq from 1) is still heard: its next record wins.
    wait_until(
        lambda: _gold(target)["gold-0"]["state"] == "ready" and _gold(target)["gold-0"]["telemetry_age_s"] < 2,
        20,
        "gold-0's own sidecar is heard again",
    )
    assert BAIT not in _eds_addresses(target)
    assert _gold(target)["gold-0"]["address"] != BAIT
    target.gold_serves()


def test_a_joined_node_cannot_claim_instances_placed_elsewhere(target):
    evil = _node_token(target, "evil")
    claimed = [
        {
            "instance_id": iid,
            "model_id": "gold",
            "version": "0.0.0",
            "state": "ready",
            "spec": {},
            "sidecar_address": BAIT,
            "control_address": BAIT,
            "worker_address": BAIT,
        }
        for iid in ("gold-0", "gold-1", "gold-7")
    ]
    for _ in range(3):
        code, _, reply = request(
            "POST",
            target.stack.admin + "/v1/nodes/heartbeat",
            {"node": "evil", "address": "http://127.0.0.1:1", "instances": claimed},
            headers=evil,
        )
        assert code == 200, reply
        assert all(a["instance_id"] not in ("gold-0", "gold-1") for a in reply["assignments"])
        time.sleep(0.5)
    # ...nor heartbeat as the real node, which would let it declare gold's instances gone.
    code, _, answer = request(
        "POST",
        target.stack.admin + "/v1/nodes/heartbeat",
        {"node": "local", "address": "http://127.0.0.1:1", "instances": []},
        headers=evil,
    )
    assert code == 403 and answer["error"]["type"] == "forbidden"
    time.sleep(1.0)  # several debounce periods: any change would have reached Envoy
    eds = _eds_addresses(target)
    assert BAIT not in eds and eds <= _registered(target), eds
    gold = _gold(target)
    assert [gold[i]["state"] for i in ("gold-0", "gold-1")] == ["ready", "ready"]
    assert all(gold[i]["address"] != BAIT and gold[i]["node"] == "local" for i in ("gold-0", "gold-1")), gold
    # An instance nobody placed is shown as the node's claim, never served: no sidecar token exists for it.
    assert gold.get("gold-7", {"in_eds": False})["in_eds"] is False
    target.gold_serves()


@pytest.mark.parametrize(
    "body",
    [
        {"node": "evil", "address": "http://x", "gpus": [{"index": 0, "name": "g", "total_mb": "lots", "used_mb": 0}]},
        {"node": "evil", "address": "http://x", "instances": "all"},
        {"node": "evil", "address": "http://x", "instances": [{"instance_id": "gold-0"}]},
        {
            "node": "evil",
            "address": "http://x",
            "gpus": [{"index": 0, "name": "g", "total_mb": 1e308, "used_mb": 0}] * 65,
        },
        {"node": "evil", "address": "http://x", "facts": {"k": ["not", "a", "string"]}},
        ["a", "list"],
    ],
)
def test_a_heartbeat_of_the_wrong_shape_is_400_and_status_keeps_answering(target, body):
    code, _, answer = request(
        "POST", target.stack.admin + "/v1/nodes/heartbeat", body, headers=_node_token(target, "evil")
    )
    assert code == 400 and answer["error"]["type"] == "invalid_spec" and answer["error"]["problems"], answer
    for _ in range(3):
        assert target.stack.status()["control_plane"]["ready"]
    target.gold_serves()


def test_telemetry_of_the_wrong_shape_is_400_and_changes_nothing(target):
    stolen = _sidecar_token(target, "gold-0")
    for bad in (
        {"in_flight": "many"},
        {"kv_cache_usage": 7},
        {"state": "asleep"},
        {"seq": -1},
        {"address": "x" * 301},
        {"extra": True},
    ):
        code, _, answer = request(
            "POST",
            target.stack.admin + "/v1/telemetry",
            _record("gold-0", **{"seq": 1, "reporter": "attacker2"} | bad),
            headers=stolen,
        )
        assert code == 400 and answer["error"]["problems"], (bad, answer)
    assert _gold(target)["gold-0"]["state"] == "ready"
    target.gold_serves()
