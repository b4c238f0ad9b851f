"""Which prefix-affinity design SIE ships (DESIGN §5), chosen by measurement: Envoy-native consistent
hashing against an external endpoint picker, on the same instances and workload, in one run.

    python -m bench.prefix_designs [--quick] [--rate R] [--out PATH]

Each design gets fresh `sim` instances behind their sidecars (bench/routing_stack.py: the same sim
parameters and shared-prefix workload as bench/prefix) and its own Envoy with a static configuration,
so the two are compared on their routing alone, without SIE's weights (equal for both):

  hash      Envoy-native: the Lua filter of bench/prefix_lua.py computes the prefix key from the
            buffered body, the route hashes it, the cluster is MAGLEV with hash_balance_factor 150.
  ext_proc  an external endpoint picker (SIE's, xds_server/picker: Python, grpc.aio): Envoy's ext_proc
            sends it headers and the buffered body, it scores the instances by the prompt blocks it
            sent them (longest prefix held) under the same bounded load, and Envoy's override_host
            policy routes to its pick (least request as the fallback). Its view of the instances is
            served here, as the control plane would (/v1/picker/endpoints, equal weights).
  least     plain LEAST_REQUEST, the reference.

Per design: TTFT p50/p90/p99, end-to-end p99, output tokens/s, the instances' cache hit rate and
shares, and the CPU each request costs on the data path: Envoy's (and the picker's) user+system time
over the measured window, per request, from /proc.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp
import yaml
from aiohttp import web

from bench import prefix_lua as prefix_key
from bench.prefix import (
    CONCURRENT,
    CONTROL_P99_RATIO,
    INSTANCES,
    MODEL,
    SHARE_RATIO,
    TTFT_RATIO,
    cache_hit_rates,
    cluster_doc,
    summary,
)
from bench.prefix_workload import Workload, closed_loop, stream_load
from bench.proc_cpu import CLK_TCK
from bench.routing_stack import RoutingStack
from bench.stack import free_port
from sie.auth import write_private
from sie.processes import find_envoy, proc_stat, terminate
from xds_server.picker import protocol as picker_protocol

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
DESIGNS = ("least", "hash", "ext_proc")
SHIPPED = "ext_proc"  # the design SIE ships (ARCHITECTURE.md section 7), judged by bench/prefix's targets


def _typed(kind: str, **fields: Any) -> dict[str, Any]:
    return {"@type": f"type.googleapis.com/{kind}", **fields}


def _endpoints(addresses: dict[str, str]) -> list[dict[str, Any]]:
    out = []
    for iid, address in sorted(addresses.items()):
        host, port = address.rsplit(":", 1)
        out.append(
            {
                "endpoint": {
                    "address": {"socket_address": {"address": host, "port_value": int(port)}},
                    "hostname": iid,
                },
                "metadata": {"filter_metadata": {"envoy.lb": {"hash_key": iid}}},
            }
        )
    return out


def bootstrap(design: str, port: int, admin: int, addresses: dict[str, str], picker_port: int | None) -> dict:
    """A static Envoy for one design (everything but the routing is the same)."""
    route: dict[str, Any] = {"cluster": "model", "timeout": "120s"}
    route_entry: dict[str, Any] = {"match": {"prefix": "/"}, "route": route}
    filters: list[dict[str, Any]] = [
        {
            "name": "envoy.filters.http.buffer",
            "typed_config": _typed("envoy.extensions.filters.http.buffer.v3.Buffer", max_request_bytes=4 << 20),
        }
    ]
    cluster: dict[str, Any] = {
        "name": "model",
        "type": "STATIC",
        "connect_timeout": "1s",
        "lb_policy": "LEAST_REQUEST",
        "load_assignment": {"cluster_name": "model", "endpoints": [{"lb_endpoints": _endpoints(addresses)}]},
        "circuit_breakers": {
            "thresholds": [{"max_requests": 4096, "max_pending_requests": 4096, "max_connections": 4096}]
        },
    }
    clusters = [cluster]
    if design == "hash":
        filters.append(
            {
                "name": prefix_key.FILTER,
                "typed_config": _typed(
                    "envoy.extensions.filters.http.lua.v3.Lua", default_source_code={"inline_string": prefix_key.SCRIPT}
                ),
            }
        )
        route["hash_policy"] = [{"header": {"header_name": prefix_key.HEADER}}]
        route_entry["metadata"] = {"filter_metadata": {prefix_key.FILTER: {prefix_key.METADATA_CHARS: 1024}}}
        cluster["lb_policy"] = "MAGLEV"
        cluster["common_lb_config"] = {"consistent_hashing_lb_config": {"hash_balance_factor": 150}}
    elif design == "ext_proc":
        filters.append(
            {
                "name": "envoy.filters.http.ext_proc",
                "typed_config": _typed(
                    "envoy.extensions.filters.http.ext_proc.v3.ExternalProcessor",
                    grpc_service={"envoy_grpc": {"cluster_name": "picker"}, "timeout": "2s"},
                    processing_mode={
                        "request_header_mode": "SEND",
                        "request_body_mode": "BUFFERED",
                        "response_header_mode": "SEND",
                        "response_body_mode": "NONE",
                        "request_trailer_mode": "SKIP",
                        "response_trailer_mode": "SKIP",
                    },
                    request_attributes=[picker_protocol.CLUSTER_ATTRIBUTE],
                    message_timeout=f"{picker_protocol.MESSAGE_TIMEOUT_S}s",
                    failure_mode_allow=True,
                ),
            }
        )
        del cluster["lb_policy"]
        cluster["load_balancing_policy"] = {
            "policies": [
                {
                    "typed_extension_config": {
                        "name": "envoy.load_balancing_policies.override_host",
                        "typed_config": _typed(
                            "envoy.extensions.load_balancing_policies.override_host.v3.OverrideHost",
                            override_host_sources=[{"header": picker_protocol.HEADER}],
                            fallback_policy={
                                "policies": [
                                    {
                                        "typed_extension_config": {
                                            "name": "envoy.load_balancing_policies.least_request",
                                            "typed_config": _typed(
                                                "envoy.extensions.load_balancing_policies.least_request.v3.LeastRequest"
                                            ),
                                        }
                                    }
                                ]
                            },
                        ),
                    }
                }
            ]
        }
        assert picker_port is not None
        clusters.append(
            {
                "name": "picker",
                "type": "STATIC",
                "connect_timeout": "1s",
                "typed_extension_protocol_options": {
                    "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": _typed(
                        "envoy.extensions.upstreams.http.v3.HttpProtocolOptions",
                        explicit_http_config={"http2_protocol_options": {}},
                    )
                },
                "load_assignment": {
                    "cluster_name": "picker",
                    "endpoints": [
                        {
                            "lb_endpoints": [
                                {
                                    "endpoint": {
                                        "address": {
                                            "socket_address": {"address": "127.0.0.1", "port_value": picker_port}
                                        }
                                    }
                                }
                            ]
                        }
                    ],
                },
            }
        )
    filters.append(
        {"name": "envoy.filters.http.router", "typed_config": _typed("envoy.extensions.filters.http.router.v3.Router")}
    )
    manager = _typed(
        "envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager",
        stat_prefix="in",
        route_config={"virtual_hosts": [{"name": "all", "domains": ["*"], "routes": [route_entry]}]},
        http_filters=filters,
    )
    return {
        "admin": {"address": {"socket_address": {"address": "127.0.0.1", "port_value": admin}}},
        "static_resources": {
            "listeners": [
                {
                    "name": "in",
                    "address": {"socket_address": {"address": "127.0.0.1", "port_value": port}},
                    "filter_chains": [
                        {
                            "filters": [
                                {"name": "envoy.filters.network.http_connection_manager", "typed_config": manager}
                            ]
                        }
                    ],
                }
            ],
            "clusters": clusters,
        },
    }


async def serve_view(stack: RoutingStack) -> tuple[web.AppRunner, str]:
    """The picker's view of the instances, as the control plane's /v1/picker/endpoints would give it, for
    the static Envoy's one cluster ("model"), equal weights."""
    view = {
        "clusters": {
            "model": {
                "balance_factor": 1.5,
                "endpoints": [
                    {"instance_id": iid, "address": stack.sidecar_addresses[iid], "weight": 1}
                    for iid in stack.instance_ids
                ],
            }
        }
    }

    async def endpoints(_: web.Request) -> web.Response:
        return web.json_response(view)

    app = web.Application()
    app.router.add_get("/v1/picker/endpoints", endpoints)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    return runner, f"http://127.0.0.1:{port}"


def cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process so far (/proc/<pid>/stat)."""
    stat = proc_stat(pid)
    if stat is None:
        raise ProcessLookupError(f"process {pid} is gone")
    return stat.ticks / CLK_TCK


async def measure(work: Path, design: str, workload: Workload, rate: float, warm_s: float, duration_s: float) -> dict:
    cluster = work / f"{design}.yaml"
    cluster.write_text(yaml.safe_dump(cluster_doc(workload), sort_keys=False))
    children: list[subprocess.Popen] = []
    async with RoutingStack(
        work / f"{design}-{workload.shared}", cluster, policy="equal", lb_policy="least_request", picker=False
    ) as stack:
        try:
            picker_port = None
            view_runner = None
            if design == "ext_proc":
                view_runner, view_url = await serve_view(stack)
                token = work / "view.token"
                write_private(token, b"unchecked")  # the view below does not check it; the picker wants 0600
                picker = subprocess.Popen(
                    [sys.executable, "-m", "xds_server.picker", "--listen", "127.0.0.1:0", "--control-url", view_url]
                    + ["--token-file", str(token), "--poll-interval-s", "0.25", "--log-level", "WARNING"],
                    stdout=subprocess.PIPE,
                    stderr=open(work / "picker.log", "ab"),  # noqa: SIM115 - closed with the process
                    start_new_session=True,
                )
                children.append(picker)
                assert picker.stdout is not None
                picker_port = int((await asyncio.to_thread(picker.stdout.readline)).decode().split(":")[-1])
                await asyncio.sleep(1.0)  # its first read of the instances
            port, admin = free_port(), free_port()
            config = work / f"{design}-envoy.json"
            config.write_text(json.dumps(bootstrap(design, port, admin, stack.sidecar_addresses, picker_port)))
            envoy = subprocess.Popen(
                [find_envoy(), "-c", str(config), "--concurrency", "1", "--base-id", str(admin), "--log-level", "warn"],
                stdout=open(work / f"{design}-envoy.log", "ab"),  # noqa: SIM115 - closed with the process
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
            children.append(envoy)
            url = f"http://127.0.0.1:{port}"
            async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
                deadline = time.monotonic() + 30
                while True:
                    try:
                        async with session.get(f"http://127.0.0.1:{admin}/ready") as resp:
                            if resp.status == 200:
                                break
                    except aiohttp.ClientError:
                        pass
                    if time.monotonic() > deadline:
                        raise RuntimeError(f"Envoy for {design} did not get ready; see {work}/{design}-envoy.log")
                    await asyncio.sleep(0.1)
                await stream_load(session, url, MODEL, workload, rate, warm_s, 0)
                pids = [c.pid for c in children]
                cpu0 = {pid: cpu_s(pid) for pid in pids}
                samples = await stream_load(session, url, MODEL, workload, rate, duration_s, 100_000)
                cpu = {pid: cpu_s(pid) - cpu0[pid] for pid in pids}
                figures = summary(samples, duration_s, stack.instance_ids)
                hits = await cache_hit_rates(session, stack)
                values = [v for v in hits.values() if v is not None]
                figures["cache_hit_rate_mean"] = round(sum(values) / len(values), 3) if values else None
                n = max(1, len(samples))
                figures["envoy_cpu_us_per_request"] = round(1e6 * cpu[envoy.pid] / n, 1)
                if design == "ext_proc":
                    figures["picker_cpu_us_per_request"] = round(1e6 * cpu[children[0].pid] / n, 1)
                figures["data_path_cpu_us_per_request"] = round(1e6 * sum(cpu.values()) / n, 1)
                return figures
        finally:
            for child in children:
                await asyncio.to_thread(terminate, child, 5.0)
            if view_runner is not None:
                await view_runner.cleanup()


async def capacity(work: Path, workload: Workload) -> float:
    """Plain least request's completions per second with every slot busy (as bench/prefix measures it)."""
    cluster = work / "probe.yaml"
    cluster.write_text(yaml.safe_dump(cluster_doc(workload), sort_keys=False))
    async with RoutingStack(
        work / f"probe-{workload.shared}",
        cluster,
        policy="equal",
        lb_policy="least_request",
        xds_flags=("--prefix-affinity", "false"),
    ) as stack:
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
            callers = INSTANCES * CONCURRENT
            await closed_loop(session, stack.ingress_url, MODEL, workload, callers, 5.0)
            return await closed_loop(session, stack.ingress_url, MODEL, workload, callers, 15.0)


async def run(quick: bool, rate: float | None, work: Path) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, workload in (("shared", Workload(shared=True)), ("control", Workload(shared=False))):
        at = rate if rate is not None else round(0.8 * await capacity(work, workload), 2)
        block: dict[str, Any] = {"rate_rps": at, "designs": {}}
        for design in DESIGNS:
            figures = await measure(work, design, workload, at, 10.0 if quick else 20.0, 30.0 if quick else 60.0)
            block["designs"][design] = figures
            print(f"  {name} {design:<9} {json.dumps({k: v for k, v in figures.items() if k != 'shares'})}", flush=True)
        out[name] = block
    return out


def judged(results: dict[str, Any]) -> list[dict[str, Any]]:
    """bench/prefix's targets for the shipped design against least request, at this bench's one rate,
    with the hash design's figure beside each (why it was not shipped)."""
    shared, control = results["shared"]["designs"], results["control"]["designs"]

    def ratio(block: dict[str, Any], design: str, key: str) -> float:
        return round(block[design][key] / block["least"][key], 3) if block["least"][key] else math.inf

    ttft, e2e = ratio(shared, SHIPPED, "ttft_p90_ms"), ratio(control, SHIPPED, "e2e_p99_ms")
    share = shared[SHIPPED]["max_share_over_mean"]
    failed = sum(d["failed"] for block in (shared, control) for d in block.values())
    return [
        {
            "target": f"shared prefix at {results['shared']['rate_rps']} req/s: {SHIPPED} TTFT p90 / least "
            f"request's <= {TTFT_RATIO} (hash: {ratio(shared, 'hash', 'ttft_p90_ms')})",
            "value": ttft,
            "limit": TTFT_RATIO,
            "holds": ttft <= TTFT_RATIO,
        },
        {
            "target": f"shared prefix: no instance serves more than {SHARE_RATIO}x the mean share under "
            f"{SHIPPED} (hash: {shared['hash']['max_share_over_mean']})",
            "value": share,
            "limit": SHARE_RATIO,
            "holds": share is not None and share <= SHARE_RATIO,
        },
        {
            "target": f"control (nothing shared) at {results['control']['rate_rps']} req/s: {SHIPPED} end-to-end "
            f"p99 / least request's <= {CONTROL_P99_RATIO} (hash: {ratio(control, 'hash', 'e2e_p99_ms')})",
            "value": e2e,
            "limit": CONTROL_P99_RATIO,
            "holds": e2e <= CONTROL_P99_RATIO,
        },
        {"target": "no request failed in any design", "value": failed, "limit": 0, "holds": failed == 0},
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.prefix_designs", description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument(
        "--rate", type=float, default=None, help="offered load (default: 80% of least request's capacity)"
    )
    parser.add_argument("--out", type=Path, default=RESULTS / "prefix_designs.json")
    parser.add_argument("--workdir", type=Path, default=None)
    args = parser.parse_args(argv)
    started = time.time()
    with tempfile.TemporaryDirectory(prefix="sie-bench-prefix-designs-") as tmp:
        work = Path(tmp) if args.workdir is None else args.workdir
        work.mkdir(parents=True, exist_ok=True)
        results = asyncio.run(run(args.quick, args.rate, work))
    doc: dict[str, Any] = {
        "benchmark": "prefix_designs",
        "setup": {
            "command": "python -m bench.prefix_designs" + (" --quick" if args.quick else ""),
            "designs": {
                "least": "static Envoy, LEAST_REQUEST",
                "hash": "static Envoy, bench/prefix_lua.py's Lua prefix key, MAGLEV, hash_balance_factor 150",
                "ext_proc": "static Envoy, ext_proc to SIE's endpoint picker (xds_server/picker), override_host",
            },
            "workload": "bench/prefix's shared-prefix workload, streamed, open loop",
            "duration_s": round(time.time() - started, 1),
        },
        "machine": {"platform": platform.platform(), "python": sys.version.split()[0], "cpus": os.cpu_count()},
        "results": results,
        "judged": judged(results),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(doc, indent=2) + "\n")
    for c in doc["judged"]:
        print(f"{'PASS' if c['holds'] else 'FAIL'}  {c['target']}: {c['value']} (limit {c['limit']})")
    return 0 if all(c["holds"] for c in doc["judged"]) else 1


if __name__ == "__main__":
    raise SystemExit(main())
