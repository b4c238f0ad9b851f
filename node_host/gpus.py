"""GPU inventory and node facts: what this node has, read from NVML, or declared with --virtual-gpus.

Real GPUs come from NVML (the `nvidia-ml-py` package, imported as `pynvml`): per device its total and
used memory, utilisation, and, separately, the memory of each process on it. On a machine without a GPU,
`--virtual-gpus 2x80GB` declares GPUs that do not exist so the same ledger and placement logic can run;
they carry `virtual=True` and a name that says so, everywhere they appear.

The NVML module is a parameter (`nvml=`), so tests pass a fake object with the same functions instead
of patching the real one. Nothing here touches NVML or the environment at import.

Units: MB means MiB (2**20 bytes), as nvidia-smi prints; "80GB" in --virtual-gpus means 80 GiB =
81920 MiB, which is what an 80 GB A100/H100 reports as its total.
"""

from __future__ import annotations

import importlib.metadata
import platform
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from sie.errors import SIEError
from sie.wire import GPUInfo

MIB = 1024 * 1024

_VIRTUAL_ITEM = re.compile(r"^\s*(\d+)\s*[xX*]\s*(\d+(?:\.\d+)?)\s*(GB|GIB|G|MB|MIB|M)\s*$", re.IGNORECASE)
_UNIT_MB = {"gb": 1024.0, "gib": 1024.0, "g": 1024.0, "mb": 1.0, "mib": 1.0, "m": 1.0}


class GPUInventoryError(SIEError):
    """The GPUs could not be read or declared; the message says how to fix it."""


@dataclass(frozen=True)
class ProcessMemory:
    """GPU memory one process holds on one device, from NVML."""

    gpu_index: int
    pid: int
    used_mb: float | None  # None where the driver does not say (e.g. inside some containers)


def parse_virtual_gpus(text: str) -> list[GPUInfo]:
    """`2x80GB`, `1x24GB,1x48GB`, `4x81920MB` -> virtual GPUs, indexed from 0 in the order given."""
    if not text or not text.strip():
        raise GPUInventoryError("--virtual-gpus is empty; give COUNTxSIZE items such as '2x80GB' or '1x24GB,1x48GB'")
    gpus: list[GPUInfo] = []
    for item in text.split(","):
        match = _VIRTUAL_ITEM.match(item)
        if match is None:
            raise GPUInventoryError(
                f"--virtual-gpus item {item.strip()!r} is not COUNTxSIZE; "
                "write e.g. '2x80GB', '1x24GB,1x48GB' or '4x81920MB' (GB means GiB, as nvidia-smi counts)"
            )
        count, size, unit = int(match.group(1)), float(match.group(2)), match.group(3).lower()
        total_mb = size * _UNIT_MB[unit]
        if count < 1 or total_mb <= 0:
            raise GPUInventoryError(
                f"--virtual-gpus item {item.strip()!r} declares nothing; count and size must be positive, e.g. '2x80GB'"
            )
        label = f"virtual GPU ({total_mb / 1024:g} GiB, simulated)"
        for _ in range(count):
            gpus.append(
                GPUInfo(index=len(gpus), name=label, total_mb=total_mb, used_mb=0.0, utilization=None, virtual=True)
            )
    return gpus


def inventory(virtual: str | None, nvml: Any = None) -> list[GPUInfo]:
    """The node's GPUs: the declared virtual ones when `virtual` is given, else NVML's real ones.

    A machine without NVML raises GPUInventoryError that points at --virtual-gpus. A machine whose NVML
    works but reports zero devices returns an empty list (a CPU-only node is legitimate: scorers run).
    """
    if virtual:
        return parse_virtual_gpus(virtual)
    nv = _nvml(nvml)
    with _session(nv):
        gpus = []
        for index in range(nv.nvmlDeviceGetCount()):
            handle = nv.nvmlDeviceGetHandleByIndex(index)
            memory = nv.nvmlDeviceGetMemoryInfo(handle)
            gpus.append(
                GPUInfo(
                    index=index,
                    name=_text(nv.nvmlDeviceGetName(handle)),
                    total_mb=memory.total / MIB,
                    used_mb=memory.used / MIB,
                    utilization=_utilisation(nv, handle),
                    virtual=False,
                )
            )
        return gpus


def process_memory(nvml: Any = None) -> list[ProcessMemory]:
    """Every compute process on every GPU with the memory NVML says it holds (the ledger's measured figure)."""
    nv = _nvml(nvml)
    with _session(nv):
        out = []
        for index in range(nv.nvmlDeviceGetCount()):
            handle = nv.nvmlDeviceGetHandleByIndex(index)
            for proc in nv.nvmlDeviceGetComputeRunningProcesses(handle):
                used = getattr(proc, "usedGpuMemory", None)
                out.append(
                    ProcessMemory(gpu_index=index, pid=int(proc.pid), used_mb=None if used is None else used / MIB)
                )
        return out


def node_facts(
    *,
    nvml: Any = None,
    version_of: Callable[[str], str | None] | None = None,
    torch_cuda: Callable[[], str | None] | None = None,
) -> dict[str, str]:
    """Versions a spec's `backend.requires` is checked against: python, torch, cuda, sglang, vllm.

    A component that is absent is left out (so `requires: [vllm]` is refused with "node does not report
    vllm"). `cuda` is the CUDA version torch was built for when torch has CUDA, else the newest CUDA the
    driver supports (NVML), else absent. Package versions come from installed metadata, which avoids
    importing sglang or vllm (seconds each, and a GPU check at import). `version_of` and `torch_cuda` are
    parameters so tests need neither package.
    """
    version_of = version_of or _installed_version
    torch_cuda = torch_cuda or _torch_cuda_version
    facts: dict[str, str] = {"python": platform.python_version()}
    for package in ("torch", "sglang", "vllm"):
        version = version_of(package)
        if version:
            facts[package] = version.split("+", 1)[0]  # "2.13.0+cu124" -> "2.13.0"; the local part is no version
    cuda = torch_cuda() if "torch" in facts else None
    if not cuda:
        cuda = _driver_cuda_version(nvml)
    if cuda:
        facts["cuda"] = cuda
    return facts


def _installed_version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def _torch_cuda_version() -> str | None:
    try:
        import torch  # noqa: PLC0415 - only when asked; importing torch costs about a second
    except ImportError:
        return None
    return getattr(torch.version, "cuda", None)


def _driver_cuda_version(nvml: Any) -> str | None:
    try:
        nv = _nvml(nvml)
        with _session(nv):
            raw = int(nv.nvmlSystemGetCudaDriverVersion())  # e.g. 12040 for CUDA 12.4
    except GPUInventoryError:
        return None
    return f"{raw // 1000}.{(raw % 1000) // 10}"


def _nvml(nvml: Any) -> Any:
    if nvml is not None:
        return nvml
    try:
        import pynvml  # noqa: PLC0415 - the package is `nvidia-ml-py`
    except ImportError as exc:
        raise GPUInventoryError(
            f"cannot import pynvml ({exc}); install nvidia-ml-py, or on a machine without a GPU pass --virtual-gpus 2x80GB"
        ) from None
    return pynvml


class _session:
    """nvmlInit/nvmlShutdown around a read; NVML errors become GPUInventoryError with the way out."""

    def __init__(self, nv: Any):
        self.nv = nv

    def __enter__(self) -> None:
        try:
            self.nv.nvmlInit()
        except Exception as exc:  # pynvml.NVMLError and friends; the fake raises its own
            raise GPUInventoryError(
                f"NVML is not available ({exc}): no NVIDIA driver here? "
                "On a machine without a GPU pass --virtual-gpus, e.g. --virtual-gpus 2x80GB"
            ) from None

    def __exit__(self, exc_type, exc, tb) -> None:
        try:
            self.nv.nvmlShutdown()
        except Exception:  # shutting down a half-initialised NVML is not worth masking the real error
            pass
        if exc is not None and not isinstance(exc, GPUInventoryError) and _is_nvml_error(self.nv, exc):
            raise GPUInventoryError(f"reading the GPUs through NVML failed: {exc}") from exc


def _is_nvml_error(nv: Any, exc: BaseException) -> bool:
    error_type = getattr(nv, "NVMLError", None)
    return isinstance(error_type, type) and isinstance(exc, error_type)


def _utilisation(nv: Any, handle: Any) -> float | None:
    try:
        return nv.nvmlDeviceGetUtilizationRates(handle).gpu / 100.0
    except Exception:  # some devices (MIG slices) do not report utilisation: unknown, not zero
        return None


def _text(value: str | bytes) -> str:
    return value.decode() if isinstance(value, bytes) else value
