"""Sleep and wake of a 1.5B model on a real NVIDIA GPU, through the torch engine's own code path.

    python -m bench.coldstart_gpu [--trials 20] [--quick] [--device cuda:0] [--out PATH]

Needs a CUDA device, a CUDA build of torch and NVML (the nvidia-ml-py package); without a CUDA device it
says so and exits 2, writing nothing. No download: a Qwen2-1.5B-shaped model (transformers Qwen2Config:
hidden 1536, 28 layers, 12 heads, 2 KV heads, intermediate 8960, vocab 151936, tied embeddings) is
built with random weights directly on the device in bfloat16. Random weights move exactly as real ones
do: the figures are about bytes, not about what the model says.

Each trial is what the torch engine does when the node host evicts an instance and wakes it again
(node_host/backends/torch_engine/offload.py, the same `Offload` object the engine holds, and the
engine's own prefill): a 512-token prefill leaves a KV cache, which is dropped as the engine drops its
decode batch; then release (every weight into one pinned host buffer, device memory freed, gc and
empty_cache) and resume (one device buffer, one copy from pinned memory, synchronize). One untimed
cycle runs first (it pays the process's first pinned allocation, which torch's host allocator keeps);
it is reported apart as `first_cycle`.

NVML's reading of this process (per-process memory; the device's used memory where the driver does not
list processes, e.g. in some containers, labelled so) is taken before and after each sleep and wake. The
node host's ledger estimate for the same model (node_host.gpu_manager.gpu_need over its config.json,
as admission computes it, with the torch engine's default KV budget of 8192 tokens) is set against what
NVML saw: what the process holds awake, and what a sleep frees (the ledger frees the whole figure, its
residue being 0). After the trials the weights are checked byte for byte and the logits of the same
prompt compared with those before the first sleep.

Writes bench/results/coldstart_gpu.json (the trials, p50/p99 of sleep and wake, memory figures, setup,
machine, and `judged`: "1.5B warm wake p99 <= 150 ms") and a table on stdout.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any, NoReturn

from bench.stats import percentile

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
MIB = 1024 * 1024
WAKE_P99_LIMIT_MS = 150.0
PROMPT_TOKENS = 512
KV_TOKENS = 8192  # sie.engine_settings.torch_engine.DEFAULT_MAX_TOTAL_TOKENS, stated in the spec below

# Qwen2-1.5B's config.json, the figures that decide its size (the estimate reads the same mapping).
QWEN2_1_5B: dict[str, Any] = {
    "model_type": "qwen2",
    "hidden_size": 1536,
    "num_hidden_layers": 28,
    "num_attention_heads": 12,
    "num_key_value_heads": 2,
    "intermediate_size": 8960,
    "vocab_size": 151936,
    "max_position_embeddings": 131072,
    "rope_theta": 1000000.0,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": True,
    "torch_dtype": "bfloat16",
}


def no_device(message: str) -> NoReturn:
    """This machine cannot run the benchmark: say what is missing and exit 2, writing nothing."""
    print(f"bench.coldstart_gpu: {message}", file=sys.stderr)
    raise SystemExit(2)


def cuda_device(name: str) -> Any:
    import torch

    if not torch.cuda.is_available():
        no_device(
            f"no CUDA device: torch {torch.__version__} (CUDA build: {torch.version.cuda or 'none'}) sees no "
            "NVIDIA GPU here. This benchmark measures a real GPU's sleep and wake; run it on a machine with "
            "an NVIDIA GPU and a CUDA build of torch. Nothing was written."
        )
    device = torch.device(name)
    if device.type != "cuda" or (device.index or 0) >= torch.cuda.device_count():
        no_device(f"--device {name!r} is not one of the {torch.cuda.device_count()} CUDA device(s) here")
    return device


class NVML:
    """What NVML says this process (or, failing that, the whole device) holds, in MiB."""

    def __init__(self, device: Any):
        try:
            import pynvml  # the nvidia-ml-py package
        except ImportError as exc:
            no_device(f"cannot import pynvml ({exc}); install the nvidia-ml-py package")
        self.nv = pynvml
        try:
            pynvml.nvmlInit()
        except pynvml.NVMLError as exc:
            no_device(f"NVML is not available ({exc}); is the NVIDIA driver loaded?")
        self.handle = self._handle(device)
        self.source = "process" if self._process_mb() is not None else "device (this process is not listed)"

    def _handle(self, device: Any) -> Any:
        """NVML's handle for torch's device: by UUID, as CUDA_VISIBLE_DEVICES may renumber devices."""
        import torch

        try:
            uuid = str(torch.cuda.get_device_properties(device).uuid)
            return self.nv.nvmlDeviceGetHandleByUUID(uuid if uuid.startswith("GPU-") else f"GPU-{uuid}")
        except Exception:  # an old torch without .uuid, or a MIG slice: fall back to the index
            return self.nv.nvmlDeviceGetHandleByIndex(device.index or 0)

    def _process_mb(self) -> float | None:
        for proc in self.nv.nvmlDeviceGetComputeRunningProcesses(self.handle):
            if int(proc.pid) == os.getpid() and getattr(proc, "usedGpuMemory", None) is not None:
                return proc.usedGpuMemory / MIB
        return None

    def used_mb(self) -> float:
        if self.source == "process":
            return self._process_mb() or 0.0
        return self.nv.nvmlDeviceGetMemoryInfo(self.handle).used / MIB

    def name(self) -> str:
        raw = self.nv.nvmlDeviceGetName(self.handle)
        return raw.decode() if isinstance(raw, bytes) else str(raw)

    def close(self) -> None:
        self.nv.nvmlShutdown()


def ledger_estimate() -> dict[str, Any]:
    """What the node host's ledger would hold for this model on admission (gpu_need, as GPUManager.admit)."""
    from node_host.gpu_manager import gpu_need
    from node_host.memory_estimate import estimate_for_spec
    from sie.spec_loader import parse_model_service

    service = parse_model_service(
        {
            "apiVersion": "sie.io/v1alpha1",
            "kind": "ModelService",
            "metadata": {"name": "qwen2-1-5b"},
            "spec": {
                "model": {"name": "qwen2-1-5b", "path": "/models/qwen2-1.5b"},
                "backend": {"type": "torch", "config": {"max_total_tokens": KV_TOKENS}},
                "resources": {"gpus": 1},
            },
        },
        "bench.coldstart_gpu",
    )
    need = gpu_need(service, read_config=lambda path: QWEN2_1_5B)
    parts = estimate_for_spec(service, QWEN2_1_5B)
    return {
        "per_gpu_mb": round(need.per_gpu_mb, 1),
        "source": need.source,
        "weights_mb": round(parts.weights_mb, 1),
        "kv_mb": round(parts.kv_mb, 1),
        "kv_tokens": parts.kv_tokens,
        "overhead_mb": round(parts.overhead_mb, 1),
        "frees_on_sleep_mb": round(need.per_gpu_mb, 1),  # the ledger's residue for a sleeper is 0
    }


def build_model(device: Any) -> Any:
    import torch
    from transformers import AutoModelForCausalLM, Qwen2Config

    config = Qwen2Config(**{k: v for k, v in QWEN2_1_5B.items() if k not in ("model_type", "torch_dtype")})
    torch.manual_seed(0)
    with torch.device(device):  # random weights made on the GPU: nothing is downloaded or copied in
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    return model.eval()


def serve_once(model: Any, ids: list[int], device: Any) -> Any:
    """One prefill as the engine runs it; returns its logits. Its KV cache is dropped on return, as the
    engine drops its decode batch before a release."""
    from node_host.backends.torch_engine.batch import prefill

    return prefill(model, ids, device).logits.float().cpu()


def cycle(offload: Any, model: Any, ids: list[int], device: Any, nvml: NVML) -> dict[str, Any]:
    import torch

    serve_once(model, ids, device)
    torch.cuda.synchronize(device)
    awake = nvml.used_mb()
    sleep = offload.release()
    asleep = nvml.used_mb()
    wake = offload.resume()
    woken = nvml.used_mb()
    return {
        "sleep_ms": sleep.seconds * 1000,
        "wake_ms": wake.seconds * 1000,
        "bytes_moved": wake.bytes_moved,
        "nvml_awake_mb": awake,
        "nvml_asleep_mb": asleep,
        "nvml_woken_mb": woken,
        "nvml_freed_mb": awake - asleep,
        "torch_freed_mb": sleep.device_freed_bytes / MIB,
        "torch_reserved_asleep_mb": sleep.device_reserved_after / MIB,
        "sleep": sleep.to_json(),
        "wake": wake.to_json(),
    }


def summarize(trials: list[dict[str, Any]], estimate: dict[str, Any]) -> dict[str, Any]:
    def p(key: str, q: float) -> float:
        return round(percentile([t[key] for t in trials], q), 2)

    wake_s = percentile([t["wake_ms"] for t in trials], 50) / 1000
    freed = p("nvml_freed_mb", 50)
    awake = p("nvml_awake_mb", 50)
    return {
        "sleep_ms": {"p50": p("sleep_ms", 50), "p99": p("sleep_ms", 99), "max": p("sleep_ms", 100)},
        "wake_ms": {"p50": p("wake_ms", 50), "p99": p("wake_ms", 99), "max": p("wake_ms", 100)},
        "wake_gb_per_s_p50": round(trials[0]["bytes_moved"] / wake_s / 1e9, 2) if wake_s > 0 else None,
        "weights_mb": round(trials[0]["bytes_moved"] / MIB, 1),
        "nvml": {
            "awake_mb_p50": awake,
            "asleep_mb_p50": p("nvml_asleep_mb", 50),  # the CUDA context and what torch cannot give back
            "freed_by_sleep_mb_p50": freed,
            "torch_freed_by_sleep_mb_p50": p("torch_freed_mb", 50),
        },
        "ledger": {
            **estimate,
            "estimate_over_nvml_awake": round(estimate["per_gpu_mb"] / awake, 3) if awake else None,
            "frees_over_nvml_freed": round(estimate["frees_on_sleep_mb"] / freed, 3) if freed else None,
        },
    }


def judged(summary: dict[str, Any]) -> list[dict[str, Any]]:
    value = summary["wake_ms"]["p99"]
    return [
        {
            "target": f"1.5B warm wake p99 <= {WAKE_P99_LIMIT_MS:g} ms",
            "value": value,
            "limit": WAKE_P99_LIMIT_MS,
            "holds": value <= WAKE_P99_LIMIT_MS,
        }
    ]


def table(summary: dict[str, Any]) -> str:
    nv, led = summary["nvml"], summary["ledger"]
    rows = [
        ("sleep p50 / p99 (ms)", f"{summary['sleep_ms']['p50']:.1f} / {summary['sleep_ms']['p99']:.1f}"),
        ("wake p50 / p99 (ms)", f"{summary['wake_ms']['p50']:.1f} / {summary['wake_ms']['p99']:.1f}"),
        ("wake copy rate p50 (GB/s)", f"{summary['wake_gb_per_s_p50']}"),
        ("weights moved (MiB)", f"{summary['weights_mb']:.0f}"),
        ("NVML awake / asleep (MiB)", f"{nv['awake_mb_p50']:.0f} / {nv['asleep_mb_p50']:.0f}"),
        ("NVML freed by a sleep (MiB)", f"{nv['freed_by_sleep_mb_p50']:.0f}"),
        (
            "ledger estimate (MiB)",
            f"{led['per_gpu_mb']:.0f} ({led['source']}; estimate/NVML awake {led['estimate_over_nvml_awake']})",
        ),
        (
            "ledger frees on sleep (MiB)",
            f"{led['frees_on_sleep_mb']:.0f} (ledger/NVML freed {led['frees_over_nvml_freed']})",
        ),
    ]
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k.ljust(width)}  {v}" for k, v in rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.coldstart_gpu", description=__doc__.split("\n\n")[0])
    parser.add_argument("--trials", type=int, default=20, help="timed sleep/wake cycles (default 20)")
    parser.add_argument("--quick", action="store_true", help="5 trials")
    parser.add_argument("--device", default="cuda:0", help="the CUDA device (default cuda:0)")
    parser.add_argument("--out", type=Path, default=RESULTS / "coldstart_gpu.json")
    args = parser.parse_args(argv)
    trials_wanted = 5 if args.quick else args.trials
    if trials_wanted < 1:
        parser.error("--trials must be at least 1")
    device = cuda_device(args.device)
    nvml = NVML(device)
    import torch

    from node_host.backends.torch_engine.offload import Offload

    estimate = ledger_estimate()
    started = time.time()
    nvml_before_model = nvml.used_mb()
    model = build_model(device)
    offload = Offload(model)
    ids = list(range(1000, 1000 + PROMPT_TOKENS))
    reference = serve_once(model, ids, device)
    probes = {name: t.detach().cpu().clone() for name, t in list(model.named_parameters())[::60]}
    print(f"model built on {device} in {time.time() - started:.1f} s; running {trials_wanted} trials", flush=True)
    first = cycle(offload, model, ids, device, nvml)
    trials = [cycle(offload, model, ids, device, nvml) for _ in range(trials_wanted)]
    after = serve_once(model, ids, device)
    params = dict(model.named_parameters())
    weights_identical = all(torch.equal(params[name].detach().cpu(), saved) for name, saved in probes.items())
    logits_max_abs_diff = float((after - reference).abs().max())
    summary = summarize(trials, estimate)
    doc: dict[str, Any] = {
        "benchmark": "coldstart_gpu",
        "setup": {
            "model": "Qwen2-1.5B-shaped, random weights made on the device, bfloat16 (no download)",
            "config": QWEN2_1_5B,
            "device": str(device),
            "gpu": nvml.name(),
            "trials": trials_wanted,
            "prompt_tokens": PROMPT_TOKENS,
            "code_path": "node_host.backends.torch_engine.offload.Offload (the torch engine's release/resume)",
            "nvml_reading": nvml.source,
            "nvml_before_model_mb": round(nvml_before_model, 1),
            "command": "python -m bench.coldstart_gpu" + (" --quick" if args.quick else f" --trials {trials_wanted}"),
        },
        "machine": {
            "platform": platform.platform(),
            "python": platform.python_version(),
            "torch": torch.__version__,
            "cuda": torch.version.cuda,
            "cpus": os.cpu_count(),
            "loadavg": os.getloadavg(),
        },
        "summary": summary,
        "checks": {"weights_identical": weights_identical, "logits_max_abs_diff": logits_max_abs_diff},
        "first_cycle": first,
        "trials": trials,
        "judged": judged(summary),
    }
    nvml.close()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(doc, indent=2) + "\n")
    print(table(summary))
    print(
        f"weights identical after {trials_wanted + 1} cycles: {weights_identical}; logits max |diff| {logits_max_abs_diff:g}"
    )
    for c in doc["judged"]:
        print(f"{'PASS' if c['holds'] else 'FAIL'}  {c['target']}: {c['value']}")
    print(f"\nwrote {args.out}")
    return 0 if weights_identical else 1


if __name__ == "__main__":
    raise SystemExit(main())
