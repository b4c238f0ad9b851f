"""Property tests (hypothesis) for every parser that reads input from outside a boundary (DESIGN §10): the
spec, telemetry, heartbeat, JSON, YAML and request-body readers raise only their own error type, and the
admin API and the running ingress answer every generated input with something below 500.

Inputs are generated two ways: arbitrary values (any JSON, any bytes, any text), and near misses, a valid
document with one leaf replaced, removed or added, which reach deeper into each parser."""

from __future__ import annotations

import asyncio
import copy
import json
import threading
import time
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from node_host.backends.protocol import BadRequest
from node_host.backends.runtime.bodies import parse_chat, parse_completion, parse_generate
from sidecar.proxy import token_problem
from sidecar.validation import check_document, compile_schema, sampling_problem
from sie import strict_json, strict_yaml
from sie.errors import InputError, SpecError
from sie.spec import IOSchema
from sie.spec_loader import parse_model_service
from sie.telemetry import TelemetryRecord
from sie.wire import NodeHeartbeat
from tests.integration.standalone_helpers import request

FAST = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
SLOW = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])

LEAVES = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=40)
)
JSONISH = st.recursive(
    LEAVES,
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=12), inner, max_size=5),
    max_leaves=25,
)

SPEC = {
    "kind": "ModelService",
    "spec": {
        "model": {"name": "chat", "priority_level": "P0", "service_type": "llm", "path": "models/chat"},
        "backend": {"type": "sim", "config": {"slowdown": 1.0}},
        "resources": {"max_concurrent_requests": 8, "gpu_memory_gb": 1.0},
        "sla": {"min_replicas": 1, "max_replicas": 3, "p99_latency_ms": 500, "max_queue_time_ms": 100},
        "input_schema": {"fields": [{"name": "text", "type": "string", "max_length": 64}]},
        "limits": {"max_new_tokens": 64},
        "routing": {"inference_paths": ["/v1/rerank"]},
    },
}
# The embedded engines' settings are part of the spec (sie.engine_settings): every key each engine reads.
ENGINE_SPECS = [
    {
        "spec": {
            "model": {"name": "chat", "path": "models/chat"},
            "backend": {
                "type": "torch",
                "config": {
                    "max_seq_len": 512,
                    "max_total_tokens": 4096,
                    "max_running_requests": 8,
                    "max_prefill_tokens": 1024,
                    "seed": 1,
                    "device": "cuda:0",
                    "dtype": "float32",
                    "num_threads": 2,
                    "demo": True,
                    "kv_budget_scale": 0.5,
                },
            },
        }
    },
    {
        "spec": {
            "model": {"name": "lr", "path": "models/lr.skops", "service_type": "scoring"},
            "backend": {
                "type": "sklearn",
                "config": {"demo": True, "seed": 3, "trusted_types": ["mylib.Scaler"], "fast_path": False},
            },
        }
    },
]
RECORD = {
    "instance_id": "chat-0",
    "model_id": "chat",
    "version": "0.0.0",
    "address": "127.0.0.1:9000",
    "node": "n1",
    "state": "ready",
    "seq": 1,
    "timestamp": 1.0,
    "reporter": "r1",
    "in_flight": 2,
    "kv_cache_usage": 0.5,
    "latency_p99_ms": 20.0,
}
HEARTBEAT = {
    "node": "n1",
    "address": "http://127.0.0.1:7070",
    "gpus": [{"index": 0, "name": "H200", "total_mb": 1000.0, "used_mb": 10.0}],
    "instances": [
        {
            "instance_id": "chat-0",
            "model_id": "chat",
            "version": "0.0.0",
            "state": "ready",
            "spec": SPEC,
            "sidecar_address": "127.0.0.1:9000",
        }
    ],
    "facts": {"python": "3.12"},
}


def _paths(doc: Any, prefix: tuple = ()) -> list[tuple]:
    out = [prefix]
    if isinstance(doc, dict):
        for key, value in doc.items():
            out += _paths(value, prefix + (key,))
    elif isinstance(doc, list):
        for i, value in enumerate(doc):
            out += _paths(value, prefix + (i,))
    return out


@st.composite
def near_miss(draw, valid: dict) -> Any:
    """`valid` with one place changed: its value replaced, the key removed, or a key added beside it."""
    doc = copy.deepcopy(valid)
    path = draw(st.sampled_from(_paths(doc)))
    if not path:
        return draw(JSONISH)
    parent = doc
    for step in path[:-1]:
        parent = parent[step]
    action = draw(st.sampled_from(["replace", "remove", "add"]))
    if action == "replace":
        parent[path[-1]] = draw(JSONISH)
    elif action == "remove" and isinstance(parent, dict):
        del parent[path[-1]]
    elif isinstance(parent, dict):
        parent[draw(st.text(max_size=12))] = draw(JSONISH)
    return doc


# ---- the parsers: only their own error escapes ---------------------------------------------------------


@FAST
@given(st.one_of(JSONISH, near_miss(SPEC), *map(near_miss, ENGINE_SPECS)))
def test_the_spec_parser_raises_only_spec_errors(doc):
    try:
        service = parse_model_service(doc, "generated")
    except SpecError as exc:
        assert exc.problems and json.dumps(exc.to_json())
        return
    json.dumps(service.to_dict())  # an accepted spec always serialises (no NaN, no infinity)


@FAST
@given(st.one_of(JSONISH, near_miss(RECORD)))
def test_the_telemetry_parser_raises_only_spec_errors(doc):
    try:
        record = TelemetryRecord.from_json(doc)
    except SpecError as exc:
        assert exc.problems
        return
    json.dumps(record.to_json(), allow_nan=False)


@FAST
@given(st.one_of(JSONISH, near_miss(HEARTBEAT)))
def test_the_heartbeat_parser_raises_only_spec_errors(doc):
    try:
        beat = NodeHeartbeat.from_json(doc)
    except SpecError as exc:
        assert exc.problems
        return
    json.dumps(beat.to_json(), allow_nan=False)


@FAST
@given(
    st.one_of(
        st.binary(max_size=200), st.text(max_size=200).map(str.encode), JSONISH.map(lambda d: json.dumps(d).encode())
    )
)
def test_the_json_reader_raises_only_input_errors_and_what_it_accepts_round_trips(data):
    try:
        doc = strict_json.loads(data)
    except InputError as exc:
        assert exc.status in (400, 413) and str(exc)
        return
    assert strict_json.loads(json.dumps(doc, allow_nan=False).encode("utf-8")) == doc


@FAST
@given(st.text(max_size=200) | JSONISH.map(lambda d: json.dumps(d)))
def test_the_yaml_reader_raises_only_input_errors(text):
    try:
        strict_yaml.load_all(text)
    except InputError as exc:
        assert exc.kind in ("invalid_yaml", "body_too_large")


GENERATE = {"text": "hi", "sampling_params": {"max_new_tokens": 8, "temperature": 0.5, "stop": ["x"]}, "stream": False}
CHAT = {
    "model": "chat",
    "messages": [{"role": "user", "content": "hi"}],
    "max_tokens": 8,
    "stream": True,
    "stream_options": {"include_usage": True},
}
COMPLETION = {"model": "chat", "prompt": "hi", "max_tokens": 8, "top_p": 0.9}


@FAST
@given(
    st.one_of(JSONISH, near_miss(GENERATE), near_miss(CHAT), near_miss(COMPLETION)),
    st.none() | st.integers(min_value=1, max_value=64),
)
def test_the_worker_body_readers_raise_only_bad_request(doc, limit):
    for parse in (parse_generate, parse_chat, parse_completion):
        try:
            parsed = parse(doc, 0.0, limit)
        except BadRequest as exc:
            assert str(exc)
            continue
        if limit is not None:
            assert parsed[0].params.max_new_tokens <= limit


SCHEMA = compile_schema(
    IOSchema.model_validate(
        {
            "fields": [
                {"name": "text", "type": "string", "max_length": 16},
                {"name": "n", "type": "int32", "range": [0, 9]},
                {"name": "x", "type": "float32", "required": False},
                {"name": "tags", "type": "array", "required": False},
            ]
        }
    )
)


@FAST
@given(
    st.one_of(JSONISH, near_miss({"text": "a", "n": 1, "x": 0.5, "tags": [1], **GENERATE})),
    st.none() | st.integers(min_value=1, max_value=64),
)
def test_the_sidecars_body_checks_never_raise(doc, limit):
    violation = check_document(SCHEMA, doc)
    assert violation is None or violation.reason
    if isinstance(doc, dict):
        problem = token_problem(doc, limit)
        assert problem is None or (problem[0] and problem[1])
        for path in ("/generate", "/v1/chat/completions", "/v1/completions"):
            sampling = sampling_problem(path, doc)
            assert sampling is None or (sampling.field and sampling.reason)


# ---- the admin API, in process: never a 5xx, never a change that breaks a later read --------------------


class _AdminInThread:
    """The real admin app on a loopback port, served from its own event loop in a thread."""

    def __init__(self):
        from aiohttp import web

        from sie.auth import Identity, Signer, TokenAuthenticator
        from xds_server.admin import AdminContext, make_app
        from xds_server.ads import AdsServer
        from xds_server.control import ControlLoop, PendingChanges
        from xds_server.credentials import TokenIssuer
        from xds_server.ingress import IngressConfig
        from xds_server.metrics import ControlPlaneMetrics
        from xds_server.policy.decisions import EqualWeights
        from xds_server.registry import Registry
        from xds_server.snapshots import SnapshotCache

        self.signer = Signer.generate()
        metrics, cache = ControlPlaneMetrics(), SnapshotCache()
        changes = PendingChanges(time.monotonic)
        self.registry = Registry(clock=time.monotonic, changes=changes, tokens=TokenIssuer(self.signer))
        self.registry.mark_synced()
        self.control = ControlLoop(
            self.registry, EqualWeights(), cache, metrics, IngressConfig(), time.monotonic, time.time, changes=changes
        )
        app = make_app(
            AdminContext(
                self.registry,
                self.control,
                metrics,
                AdsServer(cache, metrics, time.monotonic),
                time.monotonic,
                time.time,
                TokenAuthenticator(self.signer.verifier()),
                "equal",
            )
        )
        self.headers = {
            "admin": {"Authorization": f"Bearer {self.signer.issue(Identity.admin())}"},
            "sidecar": {"Authorization": f"Bearer {self.signer.issue(Identity.for_sidecar('chat-0', 'chat', 'n1'))}"},
            "node": {"Authorization": f"Bearer {self.signer.issue(Identity.for_node('n1'))}"},
        }
        self.loop = asyncio.new_event_loop()
        self.runner = web.AppRunner(app)
        ready = threading.Event()

        def serve() -> None:
            asyncio.set_event_loop(self.loop)
            self.loop.run_until_complete(self.runner.setup())
            site = web.TCPSite(self.runner, "127.0.0.1", 0)
            self.loop.run_until_complete(site.start())
            self.port = self.runner.addresses[0][1]
            ready.set()
            self.loop.run_forever()
            self.loop.run_until_complete(self.runner.cleanup())

        self.thread = threading.Thread(target=serve, daemon=True)
        self.thread.start()
        assert ready.wait(10)
        self.url = f"http://127.0.0.1:{self.port}"

    def rebuild(self) -> None:
        asyncio.run_coroutine_threadsafe(asyncio.to_thread(self.control.rebuild), self.loop).result(10)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


@pytest.fixture(scope="module")
def admin():
    server = _AdminInThread()
    yield server
    server.close()


def _bodies(valid: dict) -> st.SearchStrategy[bytes]:
    return st.one_of(
        st.binary(max_size=300),
        near_miss(valid).map(lambda d: json.dumps(d).encode()),
        JSONISH.map(lambda d: json.dumps(d).encode()),
    )


def _reads_still_answer(admin) -> None:
    for path in ("/v1/status", "/v1/models", "/v1/endpoints", "/v1/nodes", "/metrics"):
        code, _, body = request("GET", admin.url + path, headers=admin.headers["admin"], timeout=10)
        assert code == 200, (path, body)


@SLOW
@given(body=_bodies(SPEC), content_type=st.sampled_from(["application/json", "application/yaml", "text/plain"]))
def test_the_admin_api_answers_any_model_document_below_500(admin, body, content_type):
    code, _, answer = request(
        "POST",
        admin.url + "/v1/models",
        body,
        headers={"content-type": content_type, **admin.headers["admin"]},
        timeout=10,
    )
    assert code < 500, answer
    if code >= 400:
        assert answer["error"]["type"] and answer["error"]["message"]
    admin.rebuild()  # an accepted spec builds: the control loop never meets one it cannot serve
    assert not admin.control.resource_errors, admin.control.resource_errors
    _reads_still_answer(admin)


@SLOW
@given(body=_bodies(RECORD))
def test_the_admin_api_answers_any_telemetry_below_500(admin, body):
    code, _, answer = request(
        "POST",
        admin.url + "/v1/telemetry",
        body,
        headers={"content-type": "application/json", **admin.headers["sidecar"]},
        timeout=10,
    )
    assert code < 500, answer
    _reads_still_answer(admin)


@SLOW
@given(body=_bodies(HEARTBEAT))
def test_the_admin_api_answers_any_heartbeat_below_500(admin, body):
    code, _, answer = request(
        "POST",
        admin.url + "/v1/nodes/heartbeat",
        body,
        headers={"content-type": "application/json", **admin.headers["node"]},
        timeout=10,
    )
    assert code < 500, answer
    admin.rebuild()
    _reads_still_answer(admin)


# ---- the running ingress: any body to any inference path is answered below 500 --------------------------


@pytest.mark.integration
@SLOW
@given(
    body=st.one_of(
        near_miss({"model": "gold", **GENERATE}),
        near_miss({**CHAT, "model": "gold"}),
        near_miss({"model": "scorer", "text": "hello"}),
        JSONISH,
    ).map(lambda d: json.dumps(d).encode()),
    path=st.sampled_from(["/generate", "/v1/chat/completions", "/v1/completions", "/infer"]),
)
def test_the_ingress_answers_any_body_below_500(target, body, path):
    code, _, answer = request(
        "POST", target.envoy + path, body, headers={"content-type": "application/json"}, timeout=30
    )
    assert code < 500, (path, body[:200], answer)
