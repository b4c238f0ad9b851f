"""The `triton` backend against a real tritonserver 2.51 (PyPI nvidia-pytriton's binary): SIE writes the
repository for the demo scorer, starts the server with its own command line and environment, and talks
to it as the sidecar does (TritonCodec, the worker key, the repository API's unload and load, metrics).

The engine is DIR/triton where DIR is $SIE_ENGINES_DIR, else .sie/engines in this checkout (where the
node host finds it; scripts/install-engines installs it); without it the tests are skipped, saying so,
except in CI, where they fail (sie_testing/engines.py). The venv needs the model's own
packages too (scikit-learn and skops; the README's install line).
"""

from __future__ import annotations

import json
import os
import secrets
import statistics
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import skops.io as sio
from sklearn.linear_model import LogisticRegression

from node_host.backends.sklearn_engine.worker import SklearnEngine
from node_host.backends.triton_server import launch, repository
from sie import processes
from sie.engines.triton import KEY_HEADER, TRITON, codec, parse_triton_metrics
from sie.model_files import ModelFilePolicy
from sie.spec import ModelService
from sie_testing import engines, error_shape
from sie_testing.ports import free_port

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]

REPO = Path(__file__).resolve().parents[2]
MODEL = "risk-scorer"
MAX_BATCH = 8
READY_TIMEOUT_S = 90.0
TEXTS = ["great friendly service, love it", "terrible rude staff", "the delivery was slow and broken", "ok"]


def _triton_venv() -> Path:
    found = engines.require("triton")  # $SIE_ENGINES_DIR/triton (scripts/install-engines); CI fails without it
    assert found.triton_venv is not None
    venv = found.triton_venv
    if not any(venv.glob("lib/python3*/site-packages/sklearn")) or not any(
        venv.glob("lib/python3*/site-packages/skops")
    ):
        pytest.fail(
            f"{venv} has tritonserver but not scikit-learn and skops, which SIE's model imports: pip install them there"
        )
    return venv


def _spec(path: Path, backend: str) -> ModelService:
    return ModelService.model_validate(
        {
            "spec": {
                "model": {"name": MODEL, "path": str(path), "service_type": "scoring"},
                "backend": {"type": backend, "config": {"demo": True}},
                "input_schema": {"fields": [{"name": "text", "type": "string", "max_length": 4096}]},
                "output_schema": {
                    "fields": [
                        {"name": "score", "type": "float32", "range": [0.0, 1.0]},
                        {"name": "label", "type": "int32"},
                    ]
                },
                "batching": {"max_batch_size": MAX_BATCH},
            }
        }
    )


@dataclass
class Server:
    base: str
    metrics: str
    key: str
    service: ModelService
    files: ModelFilePolicy
    ready_s: float
    pid: int


def _call(
    url: str, *, body: bytes | None = None, headers: dict[str, str] | None = None, method: str | None = None
) -> tuple[int, bytes]:
    request = urllib.request.Request(
        url, data=body, headers=headers or {}, method=method or ("POST" if body is not None else "GET")
    )
    try:
        with urllib.request.urlopen(request, timeout=30) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def _ready(base: str, model: str = MODEL) -> bool:
    try:
        return _call(base + TRITON.health_path.replace("{model}", model))[0] == 200
    except OSError:
        return False


def _ours(marker: str) -> list[str]:
    """Processes whose command line names `marker` (this test's directory): the server and its stubs."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            if marker in cmdline:
                found.append(f"{entry.name} {cmdline[:200]}")
    return found


@contextmanager
def _serving(tmp: Path, service: ModelService, files: ModelFilePolicy) -> Iterator[Server]:
    """A tritonserver for `service` (its repository written under `tmp`), ready; stopped by pid afterwards,
    and nothing it started left running."""
    binary = launch.find_tritonserver(_triton_venv())
    assert binary is not None
    repository.write_repository(service, files, tmp / "repo")
    key = secrets.token_urlsafe(32)
    host, http_port, metrics_port = "127.0.0.1", free_port(), free_port()
    argv = launch.launch_command(
        tritonserver=str(binary),
        repository=tmp / "repo",
        model_id=service.model_id,
        host=host,
        http_port=http_port,
        metrics_port=metrics_port,
        api_key=key,
        backend_directory=repository.write_backends(binary, tmp / "backends"),
    )
    env = {**os.environ, **launch.launch_env(venv=_triton_venv(), base=os.environ)}
    log = tmp / "logs" / "tritonserver.log"
    started = time.monotonic()
    proc = processes.popen_in_own_session(argv, log, env=env)
    base = f"http://{host}:{http_port}"
    try:
        while not _ready(base, service.model_id):
            if proc.poll() is not None or time.monotonic() - started > READY_TIMEOUT_S:
                raise AssertionError(f"tritonserver did not get ready; log:\n{log.read_text()[-4000:]}")
            time.sleep(0.05)
        ready_s = time.monotonic() - started
        running = _ours(str(tmp))
        assert len(running) >= 2, running  # the server and its model's stub: what must be gone at the end
        yield Server(base, f"http://{host}:{metrics_port}/metrics", key, service, files, ready_s, proc.pid)
    finally:
        processes.terminate(proc, grace_s=15)
        processes.signal_group(proc.pid, 9)  # a stub that outlived its server (it shares the server's group)
        deadline = time.monotonic() + 15
        while _ours(str(tmp)) and time.monotonic() < deadline:
            time.sleep(0.1)
        left = _ours(str(tmp))
        assert not left, f"processes left behind: {left}"


@pytest.fixture(scope="module")
def server(tmp_path_factory) -> Iterator[Server]:
    _triton_venv()  # skips before anything is made when there is no engine
    tmp = tmp_path_factory.mktemp("triton")
    root = tmp / "models"
    root.mkdir()
    files = ModelFilePolicy(roots=(root,))
    with _serving(tmp, _spec(root / "risk.skops", "triton"), files) as running:
        yield running


def _infer(server: Server, doc: dict, *, key: str | None = None) -> tuple[int, bytes]:
    translate = codec(server.service)
    status, raw = _call(
        server.base + TRITON.target("/infer", server.service.model_id),
        body=translate.request(doc),
        headers={"Content-Type": "application/json", **TRITON.key_headers(server.key if key is None else key)},
    )
    return translate.response(status, raw)


async def test_scores_equal_sies_sklearn_engine_for_the_same_text(server):
    engine = SklearnEngine(_spec(server.files.roots[0] / "risk.skops", "sklearn"), server.files)
    await engine.start()
    expected = await engine.infer([{"text": t} for t in TEXTS])
    status, body = _infer(server, {"instances": [{"text": t} for t in TEXTS]})
    assert status == 200, body
    predictions = json.loads(body)["predictions"]
    assert [p["label"] for p in predictions] == [e["label"] for e in expected]
    assert [p["label"] for p in predictions[:3]] == [1, 0, 0]
    # The output is FP32 in Triton (the schema's float32); SIE's engine answers the float64 it computed.
    assert [p["score"] for p in predictions] == pytest.approx([e["score"] for e in expected], rel=1e-6, abs=1e-7)
    status, body = _infer(server, {"text": TEXTS[0]})
    assert status == 200 and json.loads(body) == predictions[0]  # one row in, one row out


def test_the_restricted_api_refuses_a_call_without_the_key(server):
    infer_path = server.base + TRITON.target("/infer", MODEL)
    body = codec(server.service).request({"text": "x"})
    for headers in ({}, {KEY_HEADER: "not-the-key-" + "x" * 20}, {"Authorization": f"Bearer {server.key}"}):
        status, raw = _call(infer_path, body=body, headers=headers)
        assert status == 403 and b"restricted" in raw, (headers, raw)
    for path in ("/v2/repository/index", f"/v2/repository/models/{MODEL}/unload"):
        assert _call(server.base + path, body=b"", method="POST")[0] == 403
    for path in (f"/v2/models/{MODEL}", f"/v2/models/{MODEL}/config", f"/v2/models/{MODEL}/stats"):
        assert _call(server.base + path)[0] == 403, path  # metadata, config (it names the file), statistics
    assert _call(server.base + "/v2/health/ready")[0] == 200  # health and metrics need no key
    assert _call(server.base + f"/v2/models/{MODEL}/ready")[0] == 200
    assert _call(server.metrics)[0] == 200
    assert _call(server.base + f"/v2/models/{MODEL}", headers={KEY_HEADER: server.key})[0] == 200


def test_a_batch_over_max_batch_size_is_the_requests_400(server):
    status, body = _infer(server, {"instances": [{"text": "a"}] * (MAX_BATCH + 1)})
    error_shape.check(status, json.loads(body))
    assert status == 400 and f"batch-size must be <= {MAX_BATCH}" in json.loads(body)["error"]["message"]


def test_unload_and_load_through_the_repository_api(server):
    sleep = TRITON.sleep(on_gpu=False)
    assert sleep.release_call is not None and sleep.resume_call is not None
    headers = TRITON.key_headers(server.key)
    status, raw = _call(server.base + sleep.release_call.path.replace("{model}", MODEL), body=b"", headers=headers)
    assert status == 200, raw
    assert not _ready(server.base)
    status, body = _infer(server, {"text": "asleep"})
    error_shape.check(status, json.loads(body))
    assert status == 503 and json.loads(body)["error"]["type"] == "unavailable"
    assert parse_triton_metrics(_call(server.metrics)[1].decode()).waiting == 0  # its lines are gone
    started = time.monotonic()
    status, raw = _call(server.base + sleep.resume_call.path.replace("{model}", MODEL), body=b"", headers=headers)
    load_s = time.monotonic() - started
    assert status == 200, raw
    assert _ready(server.base)
    status, body = _infer(server, {"text": "awake and excellent"})
    assert status == 200 and json.loads(body)["label"] == 1
    print(f"\ntriton load through the repository API: {load_s:.2f} s")


def test_metrics_parse_and_a_call_takes_about_a_millisecond(server):
    latencies = []
    for i in range(200):
        started = time.perf_counter()
        status, _ = _infer(server, {"text": TEXTS[i % len(TEXTS)]})
        latencies.append(time.perf_counter() - started)
        assert status == 200
    text = _call(server.metrics)[1].decode()
    load = parse_triton_metrics(text)
    assert (load.running, load.waiting, load.kv_usage) == (None, 0, None)
    assert f'nv_inference_request_success{{model="{MODEL}",version="1"}}' in text
    p50 = statistics.median(latencies) * 1000
    print(
        f"\ntriton ready in {server.ready_s:.2f} s; /infer p50 {p50:.2f} ms over 200 sequential calls (codec included)"
    )
    assert p50 < 50  # a scorer: milliseconds, not the hundreds a stub restart or a reload would take


async def test_numeric_fields_score_as_sies_engine_and_a_missing_value_is_the_requests_400(tmp_path):
    """Several typed inputs (float32, an optional float64, int64, a string that is no feature), NaN for the
    float left out, two model instances and dynamic batching: Triton loads what SIE wrote and scores as
    SIE's sklearn engine does; the estimator's refusal of a missing value is a 400 naming the field."""
    _triton_venv()
    root = tmp_path / "models"
    root.mkdir()
    x = np.random.default_rng(0).normal(size=(200, 3))
    sio.dump(LogisticRegression().fit(x, (x[:, 0] + x[:, 2] > 0).astype(int)), root / "num.skops")
    files = ModelFilePolicy(roots=(root,))

    def spec(backend: str) -> ModelService:
        return ModelService.model_validate(
            {
                "spec": {
                    "model": {"name": "num", "path": str(root / "num.skops"), "service_type": "scoring"},
                    "backend": {
                        "type": backend,
                        "config": {"instance_count": 2, "dynamic_batching": {"max_queue_delay_microseconds": 500}}
                        if backend == "triton"
                        else {},
                    },
                    "input_schema": {
                        "fields": [
                            {"name": "a", "type": "float32"},
                            {"name": "b", "type": "float64", "required": False},
                            {"name": "c", "type": "int64"},
                            {"name": "note", "type": "string", "required": False},
                        ]
                    },
                    "output_schema": {
                        "fields": [{"name": "p", "type": "float64"}, {"name": "label", "type": "string"}]
                    },
                }
            }
        )

    rows = [{"a": 0.5, "b": -1.25, "c": 2, "note": "x"}, {"a": -2.0, "b": 0.75, "c": -1}]
    engine = SklearnEngine(spec("sklearn"), files)
    await engine.start()
    expected = await engine.infer(rows)
    with _serving(tmp_path, spec("triton"), files) as running:
        status, body = _infer(running, {"instances": rows})
        assert status == 200, body
        predictions = json.loads(body)["predictions"]
        assert [p["label"] for p in predictions] == [e["label"] for e in expected] == ["1", "0"]
        assert [p["p"] for p in predictions] == pytest.approx([e["p"] for e in expected], rel=1e-9)  # FP64 both ways
        status, body = _infer(running, {"instances": [rows[0], {"a": 1.0, "c": 0}]})
        error_shape.check(status, json.loads(body))
        assert status == 400 and "instances[1].b: left out" in json.loads(body)["error"]["message"]
