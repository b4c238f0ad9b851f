"""A real Prometheus (Debian's `prometheus`, started here) scrapes the sidecars of a running `sie up` stack,
found through SIE's http_sd endpoint, and the README's PromQL line for "P0 models whose p99 latency is
over 500 ms" names exactly the P0 model that was slowed.

The cluster: two P0 sim models and one P1 sim model, one instance each. Under a light open-loop load all
three are fast and the query returns nothing (while the same query without `> 0.5` shows both P0 models,
so "nothing" is a real answer, not missing data). Then the simulator of one P0 model AND of the P1 model is
slowed (POST /v1/models/<id>/sim/config through Envoy) so both answer in over a second: the query must
return the slowed P0 model only. Slowing the P1 model too is what makes the priority filter matter.

The node host (on a virtual 80 GiB GPU; each model declares 2 GiB) is found through the same endpoint
(`?role=node`) and scraped too: the README's "where is GPU memory going" line names each model with what
the ledger holds for it.

Prometheus runs with the scrape configuration of examples/prometheus.yaml, its URLs pointed at this
stack and its intervals cut to 1 s; it is stopped by its pid.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import random
import shutil
import subprocess
import textwrap
import threading
import urllib.parse
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import pytest
import yaml

from sie.processes import terminate
from tests.integration.standalone_helpers import REPO, free_port, request, start_stack, stop_stack, wait_until

pytestmark = [
    pytest.mark.integration,
    pytest.mark.timeout(240),
    pytest.mark.skipif(
        shutil.which("prometheus") is None, reason="needs Debian's prometheus package (apt-get install prometheus)"
    ),
]

# The README's line, verbatim (test_the_query_is_the_readmes checks it is still there).
P0_OVER_500MS = (
    "histogram_quantile(0.99, sum by (model_id, le) (rate(inference_latency_seconds_bucket"
    '{priority_level="P0"}[1m]))) > 0.5'
)
WHERE_GPU_MEMORY_GOES = "sort_desc(sum by (node, gpu, model_id) (sie_gpu_instance_memory_bytes))"
MODEL_GPU_MB = 2048
P0_P99 = P0_OVER_500MS.removesuffix(" > 0.5")
ALL_OVER_500MS = P0_OVER_500MS.replace('{priority_level="P0"}', "")

# Default sim timing: ~4 ms per engine iteration, so 4 tokens take ~20 ms; x50 takes ~1 s and more.
SLOWDOWN = 50.0
RATE_PER_MODEL_RPS = 6.0
MODELS = {"p0-fast": "P0", "p0-slow": "P0", "p1-slow": "P1"}
# The SLA is far above the slowed latency, so the weight policy never sheds the slowed P1 model's load
# (it would, rightly, at an SLA of 500 ms) and every request is answered.

CLUSTER = "\n---\n".join(
    textwrap.dedent(f"""\
    kind: ModelService
    spec:
      model: {{name: {name}, service_type: llm, priority_level: {prio}}}
      backend: {{type: sim}}
      resources: {{max_concurrent_requests: 64, min_gpu_memory_mb: {MODEL_GPU_MB}}}
      sla: {{p99_latency_ms: 5000, max_queue_time_ms: 5000, min_replicas: 1}}
    """)
    for name, prio in MODELS.items()
)


def prometheus_config(admin: str, envoy_stats: str, reader_token: Path) -> dict:
    """examples/prometheus.yaml pointed at this stack (and its reader token), with 1 s intervals."""
    config = yaml.safe_load((REPO / "examples" / "prometheus.yaml").read_text())
    config["global"] = {"scrape_interval": "1s", "evaluation_interval": "1s"}
    admin_host = urllib.parse.urlsplit(admin).netloc
    for job in config["scrape_configs"]:
        if "authorization" in job:
            job["authorization"]["credentials_file"] = str(reader_token)
        for sd in job.get("http_sd_configs", []):
            url = urllib.parse.urlsplit(sd["url"])
            sd["url"] = admin + url.path + (f"?{url.query}" if url.query else "")
            sd["refresh_interval"] = "1s"
            if "authorization" in sd:
                sd["authorization"]["credentials_file"] = str(reader_token)
        for static in job.get("static_configs", []):
            if job.get("metrics_path") == "/stats/prometheus":
                static["targets"] = [urllib.parse.urlsplit(envoy_stats).netloc]  # its stats listener
            else:
                static["targets"] = [admin_host]
    return config


@contextlib.contextmanager
def running_prometheus(workdir: Path, config: dict) -> Iterator[str]:
    port = free_port()
    config_path = workdir / "prometheus.yaml"
    config_path.write_text(yaml.safe_dump(config))
    log_path = workdir / "prometheus.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [
                "prometheus",
                f"--config.file={config_path}",
                f"--storage.tsdb.path={workdir / 'tsdb'}",
                f"--web.listen-address=127.0.0.1:{port}",
                "--log.level=warn",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until(
            lambda: proc.poll() is not None or request("GET", url + "/-/ready", timeout=2)[0] == 200,
            30,
            "Prometheus is ready",
        )
        assert proc.poll() is None, f"prometheus exited {proc.returncode}:\n{log_path.read_text()[-3000:]}"
        yield url
    finally:
        terminate(proc, grace_s=15)


class OpenLoopLoad:
    """Poisson arrivals at every model through Envoy, in a thread of its own, until stop()."""

    def __init__(self, envoy: str, models: list[str], rate_per_model_rps: float):
        self.envoy, self.models, self.rate = envoy, models, rate_per_model_rps * len(models)
        self.statuses: dict[str, list[int]] = {m: [] for m in models}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=lambda: asyncio.run(self._run()), name="open-loop-load", daemon=True)

    async def _run(self) -> None:
        rng = random.Random(7)
        tasks: set[asyncio.Task] = set()
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as session:

            async def one(model: str) -> None:
                body = {"model": model, "prompt": "how slow is this model today", "max_tokens": 4}
                try:
                    async with session.post(self.envoy + "/v1/completions", json=body) as resp:
                        await resp.read()
                        self.statuses[model].append(resp.status)
                except (TimeoutError, aiohttp.ClientError):
                    self.statuses[model].append(0)

            i = 0
            while not self._stop.is_set():
                await asyncio.sleep(rng.expovariate(self.rate))
                task = asyncio.create_task(one(self.models[i % len(self.models)]), name=f"load-{i}")
                tasks.add(task)
                task.add_done_callback(tasks.discard)
                i += 1
            await asyncio.gather(*tasks, return_exceptions=True)

    def start(self) -> OpenLoopLoad:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=60)


def query(prometheus: str, promql: str) -> dict[str, float]:
    """model_id -> value of an instant query."""
    code, _, body = request("GET", prometheus + "/api/v1/query?" + urllib.parse.urlencode({"query": promql}), timeout=5)
    assert code == 200 and body["status"] == "success", body
    return {r["metric"].get("model_id", "?"): float(r["value"][1]) for r in body["data"]["result"]}


def test_the_queries_are_the_readmes():
    readme = (REPO / "README.md").read_text()
    assert P0_OVER_500MS in readme and WHERE_GPU_MEMORY_GOES in readme


def test_p0_over_500ms_names_the_slowed_p0_model(tmp_path):
    cluster_file = tmp_path / "cluster.yaml"
    cluster_file.write_text(CLUSTER)
    stack = start_stack(tmp_path, cluster_file, timeout=150, extra=("--virtual-gpus", "1x80GB"))
    load = None
    try:
        code, _, targets = stack.request("GET", stack.admin + "/v1/prometheus/targets")
        assert code == 200 and sorted(g["labels"]["model_id"] for g in targets) == sorted(MODELS)
        reader = stack.run_dir / "credentials" / "reader.token"
        with running_prometheus(tmp_path, prometheus_config(stack.admin, stack.envoy_stats, reader)) as prometheus:

            def sidecars_up() -> bool:
                _, _, body = request("GET", prometheus + "/api/v1/targets?state=active", timeout=5)
                up = {
                    t["labels"].get("instance_id")
                    for t in body["data"]["activeTargets"]
                    if t["labels"]["job"] == "sie-sidecars" and t["health"] == "up"
                }
                return len(up) == len(MODELS)

            wait_until(sidecars_up, 30, "Prometheus scrapes the three sidecars it discovered through http_sd")

            # The node host, found through ?role=node: where its GPU memory goes, by model.
            def node_host_up() -> bool:
                _, _, body = request("GET", prometheus + "/api/v1/targets?state=active", timeout=5)
                return any(
                    t["labels"]["job"] == "sie-node-hosts"
                    and t["labels"].get("node") == "local"
                    and t["health"] == "up"
                    for t in body["data"]["activeTargets"]
                )

            wait_until(node_host_up, 30, "Prometheus scrapes the node host it discovered through http_sd")
            going = wait_until(lambda: query(prometheus, WHERE_GPU_MEMORY_GOES), 15, "GPU memory by model")
            assert going == {model: MODEL_GPU_MB * 2**20 for model in MODELS}, going

            load = OpenLoopLoad(stack.envoy, list(MODELS), RATE_PER_MODEL_RPS).start()
            # All fast: the P0 p99s exist (so the empty answer below means "under 500 ms") and are low.
            # NaN means a series exists but saw no request in the rate window yet: wait for real figures.
            p0 = wait_until(
                lambda: (
                    (r := query(prometheus, P0_P99)).keys() == {"p0-fast", "p0-slow"}
                    and all(math.isfinite(v) for v in r.values())
                    and r
                ),
                30,
                "Prometheus has latency rates of both P0 models",
            )
            assert all(v < 0.5 for v in p0.values()), p0
            assert query(prometheus, P0_OVER_500MS) == {}

            node = json.loads((stack.run_dir / "node_host.json").read_text())["address"]
            _, _, listed = stack.request("GET", node + "/v1/instances")
            for model in ("p0-slow", "p1-slow"):
                # The simulator's knob is a worker control endpoint: only its node host and sidecar, which
                # hold the worker's key, may call it (never through the ingress).
                inst = next(i for i in listed["instances"] if i["model_id"] == model)
                key = (stack.run_dir / "secrets" / f"{inst['instance_id']}.worker-key").read_text().strip()
                code, _, body = request(
                    "POST",
                    f"http://{inst['worker_address']}/sim/config",
                    {"slowdown": SLOWDOWN},
                    headers={"Authorization": f"Bearer {key}"},
                )
                assert code == 200, body
            # Both slowed models go over 500 ms, and the README's query names only the P0 one.
            wait_until(
                lambda: query(prometheus, ALL_OVER_500MS).keys() == {"p0-slow", "p1-slow"},
                45,
                "the p99 of both slowed models is over 500 ms",
            )
            slow_p0 = query(prometheus, P0_OVER_500MS)
            assert slow_p0.keys() == {"p0-slow"}, slow_p0
            assert query(prometheus, P0_P99)["p0-fast"] < 0.5
            load.stop()
            for model, statuses in load.statuses.items():
                assert statuses and set(statuses) == {200}, (model, sorted(set(statuses)))
            load = None
    finally:
        if load is not None:
            load.stop()
        stop_stack(stack)
