"""A STAND-IN for `python -m sglang.launch_server`, for tests on machines without a GPU. Not SGLang.

It parses SGLang's launch arguments the way SGLang does (argparse, unknown arguments rejected with exit
status 2), then serves the subset of SGLang's HTTP protocol that SIE uses, with deterministic echo text
instead of a model:

    GET  /health, /v1/models, /v1/loads, /metrics (only with --enable-metrics, like SGLang),
         /server_info (alias /get_server_info: the parsed arguments, plus `"standin": true`), /model_info
    POST /generate, /v1/chat/completions, /v1/completions,
         /release_memory_occupation, /resume_memory_occupation  ({"tags": [...]}, none = all)

It mirrors the behaviours node_host must respect:
  * release without --enable-memory-saver is refused (400);
  * release while a request is in flight makes the process exit non-zero, as SGLang's idle assert
    takes the real server down; so does a generation while the weights or KV cache are released;
  * weights released without --enable-weights-cpu-backup come back as garbage: generations then fail.

Test knobs come from the environment, never from arguments (SGLang would reject unknown arguments):
STANDIN_STARTUP_DELAY_S (seconds before /health turns 200; default 0) and STANDIN_TOKEN_DELAY_S (seconds
per generated token; default 0).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import sys
import time

from aiohttp import web

log = logging.getLogger("sglang-standin")
STANDIN_VERSION = "0.0.0-standin"
TAGS = ("weights", "kv_cache", "cuda_graph")


def build_parser() -> argparse.ArgumentParser:
    """SGLang's launch arguments that SIE's adapter and common deployments use (names as in ServerArgs)."""
    p = argparse.ArgumentParser(prog="sglang.launch_server (stand-in)", allow_abbrev=False)
    p.add_argument("--model-path", "--model", dest="model_path", required=True)
    p.add_argument("--tokenizer-path")
    p.add_argument("--revision")
    p.add_argument("--served-model-name")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=30000)
    p.add_argument("--nccl-port", type=int)
    p.add_argument("--mem-fraction-static", type=float)
    p.add_argument("--max-total-tokens", type=int)
    p.add_argument("--max-running-requests", type=int)
    p.add_argument("--max-prefill-tokens", type=int)
    p.add_argument("--chunked-prefill-size", type=int)
    p.add_argument("--context-length", type=int)
    p.add_argument("--tp-size", "--tp", dest="tp_size", type=int, default=1)
    p.add_argument("--dp-size", "--dp", dest="dp_size", type=int, default=1)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--kv-cache-dtype", default="auto")
    p.add_argument("--quantization")
    p.add_argument("--trust-remote-code", action="store_true")
    p.add_argument("--attention-backend")
    p.add_argument("--schedule-policy", default="fcfs")
    p.add_argument("--schedule-conservativeness", type=float, default=1.0)
    p.add_argument("--page-size", type=int, default=1)
    p.add_argument("--cuda-graph-max-bs-decode", type=int)
    p.add_argument("--cuda-graph-bs-decode", type=int, nargs="+")
    p.add_argument("--disable-cuda-graph", action="store_true")
    p.add_argument("--disable-radix-cache", action="store_true")
    p.add_argument("--enable-torch-compile", action="store_true")
    p.add_argument("--json-model-override-args", default="{}")
    p.add_argument("--random-seed", type=int)
    p.add_argument("--api-key")
    p.add_argument("--log-level", default="info")
    p.add_argument("--decode-log-interval", type=int, default=40)
    p.add_argument("--stream-interval", type=int, default=1)
    p.add_argument("--watchdog-timeout", type=float, default=300)
    p.add_argument("--enable-metrics", action="store_true")
    p.add_argument("--enable-memory-saver", action="store_true")
    p.add_argument("--enable-weights-cpu-backup", action="store_true")
    p.add_argument("--skip-server-warmup", action="store_true")
    return p


class StandIn:
    def __init__(self, args: argparse.Namespace, *, startup_delay_s: float, token_delay_s: float):
        self.args = args
        self.name = args.served_model_name or args.model_path
        self.startup_delay_s = startup_delay_s
        self.token_delay_s = token_delay_s
        self.started = time.monotonic()
        self.in_flight = 0
        self.released: set[str] = set()
        self.weights_lost = False
        self.generated_tokens = 0

    # --- lifecycle -----------------------------------------------------------------------------

    def ready(self) -> bool:
        return time.monotonic() - self.started >= self.startup_delay_s

    def crash(self, why: str) -> None:
        # SGLang's scheduler dies on these; the whole server goes with it. Mirror that, loudly.
        log.error("stand-in crashing like SGLang would: %s", why)
        sys.stderr.flush()
        os._exit(3)

    # --- handlers ------------------------------------------------------------------------------

    async def health(self, _: web.Request) -> web.Response:
        return web.Response(status=200 if self.ready() else 503)

    async def models(self, _: web.Request) -> web.Response:
        card = {
            "id": self.name,
            "object": "model",
            "owned_by": "sglang",
            "root": self.args.model_path,
            "max_model_len": self.args.context_length,
        }
        return web.json_response({"object": "list", "data": [card]})

    async def server_info(self, _: web.Request) -> web.Response:
        info = {
            **vars(self.args),
            "version": STANDIN_VERSION,
            "standin": True,
            "released_tags": sorted(self.released),
            "weights_lost": self.weights_lost,
            "internal_states": [{"in_flight": self.in_flight}],
        }
        return web.json_response(info)

    async def model_info(self, _: web.Request) -> web.Response:
        return web.json_response({"model_path": self.args.model_path, "is_generation": True, "standin": True})

    async def loads(self, _: web.Request) -> web.Response:
        capacity = self.args.max_total_tokens or 0
        used = min(capacity, self.in_flight * 16)
        rank = {
            "dp_rank": 0,
            "num_running_reqs": self.in_flight,
            "num_waiting_reqs": 0,
            "num_used_tokens": used,
            "max_total_num_tokens": capacity,
            "token_usage": used / capacity if capacity else 0.0,
            "gen_throughput": 0.0,
            "cache_hit_rate": 0.0,
            "utilization": 0.0,
            "max_running_requests": self.args.max_running_requests or 0,
            "num_total_reqs": self.in_flight,
        }
        aggregate = {
            "total_running_reqs": self.in_flight,
            "total_waiting_reqs": 0,
            "total_reqs": self.in_flight,
            "avg_token_usage": rank["token_usage"],
            "avg_throughput": 0.0,
            "avg_utilization": 0.0,
        }
        return web.json_response(
            {
                "timestamp": time.time(),
                "version": STANDIN_VERSION,
                "dp_rank_count": 1,
                "loads": [rank],
                "aggregate": aggregate,
            }
        )

    async def metrics(self, _: web.Request) -> web.Response:
        if not self.args.enable_metrics:
            raise web.HTTPNotFound(text="metrics are off; launch with --enable-metrics")
        label = f'{{model_name="{self.name}"}}'
        capacity = self.args.max_total_tokens or 0
        lines = []
        for metric, value in (
            ("sglang:num_running_reqs", self.in_flight),
            ("sglang:num_queue_reqs", 0),
            ("sglang:num_used_tokens", min(capacity, self.in_flight * 16)),
            ("sglang:max_total_num_tokens", capacity),
            ("sglang:token_usage", min(capacity, self.in_flight * 16) / capacity if capacity else 0.0),
            ("sglang:gen_throughput", 0.0),
        ):
            lines += [f"# TYPE {metric} gauge", f"{metric}{label} {float(value)}"]
        return web.Response(text="\n".join(lines) + "\n", content_type="text/plain")

    async def generate(self, request: web.Request) -> web.Response:
        body = await request.json()
        text = body.get("text") or " ".join(str(i) for i in body.get("input_ids", []))
        max_new = int((body.get("sampling_params") or {}).get("max_new_tokens", 16))
        out, took = await self._run(str(text), max_new)
        return web.json_response(
            {
                "text": out,
                "meta_info": {
                    "id": body.get("rid") or "standin",
                    "prompt_tokens": len(str(text).split()),
                    "completion_tokens": max_new,
                    "e2e_latency": took,
                    "finish_reason": {"type": "length", "length": max_new},
                },
            }
        )

    async def chat(self, request: web.Request) -> web.Response:
        body = await request.json()
        prompt = " ".join(str(m.get("content", "")) for m in body.get("messages", []))
        max_new = int(body.get("max_tokens") or body.get("max_completion_tokens") or 16)
        out, _ = await self._run(prompt, max_new)
        return web.json_response(
            {
                "id": "chatcmpl-standin",
                "object": "chat.completion",
                "created": int(time.time()),
                "model": self.name,
                "choices": [{"index": 0, "message": {"role": "assistant", "content": out}, "finish_reason": "length"}],
                "usage": {
                    "prompt_tokens": len(prompt.split()),
                    "completion_tokens": max_new,
                    "total_tokens": len(prompt.split()) + max_new,
                },
            }
        )

    async def completions(self, request: web.Request) -> web.Response:
        body = await request.json()
        prompt = str(body.get("prompt", ""))
        max_new = int(body.get("max_tokens") or 16)
        out, _ = await self._run(prompt, max_new)
        return web.json_response(
            {
                "id": "cmpl-standin",
                "object": "text_completion",
                "model": self.name,
                "choices": [{"index": 0, "text": out, "finish_reason": "length"}],
                "usage": {"prompt_tokens": len(prompt.split()), "completion_tokens": max_new},
            }
        )

    async def release(self, request: web.Request) -> web.Response:
        if not self.args.enable_memory_saver:
            return web.json_response(
                {"success": False, "message": "launch with --enable-memory-saver to release memory"}, status=400
            )
        tags = await self._tags(request)
        if self.in_flight:
            self.crash(f"release_memory_occupation with {self.in_flight} requests in flight (the server must be idle)")
        if "weights" in tags and not self.args.enable_weights_cpu_backup:
            self.weights_lost = True
        self.released |= set(tags)
        return web.json_response({"success": True, "message": f"released {sorted(tags)}"})

    async def resume(self, request: web.Request) -> web.Response:
        tags = await self._tags(request)
        self.released -= set(tags)
        return web.json_response({"success": True, "message": f"resumed {sorted(tags)}"})

    # --- helpers -------------------------------------------------------------------------------

    async def _tags(self, request: web.Request) -> list[str]:
        raw = await request.text()
        tags = (json.loads(raw) if raw.strip() else {}).get("tags") or list(TAGS)
        unknown = set(tags) - set(TAGS)
        if unknown:
            raise web.HTTPBadRequest(text=f"unknown tags {sorted(unknown)}")
        return tags

    async def _run(self, prompt: str, max_new: int) -> tuple[str, float]:
        if not self.ready():
            raise web.HTTPServiceUnavailable(text="the server is starting")
        if self.released & {"weights", "kv_cache"}:
            self.crash(f"generation while {sorted(self.released)} released: the real server would use freed memory")
        if self.weights_lost:
            raise web.HTTPInternalServerError(text="weights were released without --enable-weights-cpu-backup")
        started = time.monotonic()
        self.in_flight += 1
        try:
            if self.token_delay_s:
                await asyncio.sleep(self.token_delay_s * max_new)
        finally:
            self.in_flight -= 1
        self.generated_tokens += max_new
        words = (prompt.split() or ["ok"]) * max_new
        return " ".join(words[:max_new]), time.monotonic() - started


def make_app(standin: StandIn) -> web.Application:
    app = web.Application()
    s = standin
    for path, handler in (
        ("/health", s.health),
        ("/health_generate", s.health),
        ("/v1/models", s.models),
        ("/server_info", s.server_info),
        ("/get_server_info", s.server_info),
        ("/model_info", s.model_info),
        ("/get_model_info", s.model_info),
        ("/v1/loads", s.loads),
        ("/metrics", s.metrics),
    ):
        app.router.add_get(path, handler)
    for path, handler in (
        ("/generate", s.generate),
        ("/v1/chat/completions", s.chat),
        ("/v1/completions", s.completions),
        ("/release_memory_occupation", s.release),
        ("/resume_memory_occupation", s.resume),
    ):
        app.router.add_post(path, handler)
    return app


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)  # unknown arguments: argparse prints usage and exits 2, like SGLang
    logging.basicConfig(
        level=getattr(logging, args.log_level.upper(), logging.INFO), format="%(name)s %(levelname)s %(message)s"
    )
    standin = StandIn(
        args,
        startup_delay_s=float(os.environ.get("STANDIN_STARTUP_DELAY_S", "0")),
        token_delay_s=float(os.environ.get("STANDIN_TOKEN_DELAY_S", "0")),
    )
    log.info("SGLang STAND-IN (not SGLang) serving %s on %s:%d", standin.name, args.host, args.port)
    web.run_app(make_app(standin), host=args.host, port=args.port, print=None, access_log=None)


if __name__ == "__main__":
    main()
