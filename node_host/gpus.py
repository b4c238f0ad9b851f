"""GPU inventory and node facts: what this node has, read from NVML, or declared with --virtual-gpus.

Real GPUs come from NVML (the `nvidia-ml-py` package, imported as `pynvml`): per device its total and
used memory, utilisation, and, separately, the memory of each process on it; and each device's health
(`health`: temperature, uncorrected ECC errors, a lost device, fatal Xid events). On a machine without a GPU,
`--virtual-gpus 2x80GB` declares GPUs that do not exist so the same ledger and placement logic can run;
they carry `virtual=True` and a name that says so, everywhere they appear.

The NVML module is a parameter (`nvml=`), so tests pass a fake object with the same functions instead
of patching the real one. Nothing here touches NVML or the environment at import.

Units: MB means MiB (2**20 bytes), as nvidia-smi prints; "80GB" in --virtual-gpus means 80 GiB =
81920 MiB, which is what an 80 GB A100/H100 reports as its total.
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib.metadata
import logging
import platform
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import Any

from sie.errors import SIEError
from sie.wire import GPUInfo

log = logging.getLogger(__name__)

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


# ---- health ----------------------------------------------------------------------------------------

# Xids after which a GPU is lost or must be reset before it can be trusted: NVIDIA's Xid catalog
# (https://docs.nvidia.com/deploy/xid-errors/analyzing-xid-catalog.html, resolution bucket RESET_GPU or
# worse) and NVIDIA Health Validation's Xid checks (https://docs.nvidia.com/health-validation/reference/
# checks/xid.html: severity CRITICAL, action drain then reset_gpu). Any other Xid, e.g. 13 (graphics
# engine exception) or 31 (memory page fault), is one application's fault: its process dies and the GPU
# serves the next one, so it fails nothing here.
FATAL_XIDS: Mapping[int, str] = {
    46: "GPU stopped processing",
    48: "double-bit ECC error",
    62: "internal micro-controller halt",
    63: "row remapping pending (the GPU needs a reset)",
    64: "row remapping failure",
    74: "NVLink error",
    79: "fallen off the bus",
    92: "high single-bit ECC error rate",
    94: "contained ECC error",
    95: "uncontained ECC error",
    119: "GSP RPC timeout",
    120: "GSP error",
}
_MAX_EVENTS_PER_POLL = 1024  # a storm of events is read over several polls, never in an endless loop


@dataclass(frozen=True)
class GpuHealth:
    index: int
    temperature_c: float | None = None  # None where NVML does not say (or the device is lost)
    failed: str = ""  # why the GPU must not be used ("" while healthy); see `health`


def health(
    nvml: Any = None, *, xids: XidWatch | None = None, before: Mapping[int, GpuHealth] | None = None
) -> dict[int, GpuHealth]:
    """Each real GPU's health by index: its temperature, and `failed` with the reason when the device is
    lost ("device lost"), has uncorrected ECC errors since the driver loaded ("uncorrected ECC errors
    (N)"), or a fatal Xid event arrived (FATAL_XIDS: "Xid 79: fallen off the bus"). A check NVML does
    not support (ECC on a GPU without it) is unknown, not a failure.

    A failure is sticky: pass the previous answer as `before`, and every GPU failed there stays failed
    with its first reason, whatever NVML says now; only a restart of the node host forgets it. How to
    call it (every call blocks on NVML: run it in an executor; never for --virtual-gpus):

        xids = XidWatch.start()                       # once, at start (blocks too); None: no Xid events here
        last: dict[int, GpuHealth] = {}
        # each heartbeat:
        last = await loop.run_in_executor(None, functools.partial(health, xids=xids, before=last))
        # at shutdown: if xids is not None: xids.close()

    Raises GPUInventoryError when NVML cannot be used at all (no driver)."""
    nv = _nvml(nvml)
    with _session(nv):
        now = {index: _device_health(nv, index) for index in range(nv.nvmlDeviceGetCount())}
    for index, reason in (xids.poll() if xids is not None else {}).items():  # an Xid says best why
        now[index] = replace(now.get(index, GpuHealth(index)), failed=reason)
    for index, old in (before or {}).items():
        if old.failed:
            now[index] = replace(now.get(index, GpuHealth(index)), failed=old.failed)
    return dict(sorted(now.items()))


class XidWatch:
    """NVML's critical Xid events of every GPU, read without waiting: create it once, `poll` it often.

    It holds an NVML session open for its lifetime (its event set lives only while NVML is initialised),
    so `close` it at shutdown. Every method blocks on NVML: run them in an executor."""

    def __init__(self, nvml: Any = None):
        nv = self._nv = _nvml(nvml)
        self._set: Any = None
        self._by_handle: dict[Any, int] = {}
        try:
            nv.nvmlInit()
        except Exception as exc:  # as _session: the fake raises its own
            raise GPUInventoryError(f"NVML is not available ({exc}): no Xid events") from None
        self._open = True
        try:
            self._set = nv.nvmlEventSetCreate()
            for index in range(nv.nvmlDeviceGetCount()):
                handle = nv.nvmlDeviceGetHandleByIndex(index)
                try:
                    nv.nvmlDeviceRegisterEvents(handle, nv.nvmlEventTypeXidCriticalError, self._set)
                    self._by_handle[_handle_key(handle)] = index
                except Exception as exc:
                    if not _is_nvml_error(nv, exc):
                        raise
                    log.warning("GPU %d gives no Xid events (%s); its health is read without them", index, exc)
        except Exception as exc:
            self.close()
            if _is_nvml_error(nv, exc):
                raise GPUInventoryError(f"cannot watch Xid events through NVML: {exc}") from exc
            raise

    @classmethod
    def start(cls, nvml: Any = None) -> XidWatch | None:
        """A watch, or None (the reason logged) where NVML gives no events: health then goes without."""
        try:
            return cls(nvml)
        except GPUInventoryError as exc:
            log.warning("%s; GPU health is read without Xid events", exc)
            return None

    @property
    def watched(self) -> tuple[int, ...]:  # the GPUs whose events it receives
        return tuple(sorted(self._by_handle.values()))

    def poll(self) -> dict[int, str]:
        """The GPUs that fatal Xid events since the last poll failed: index -> "Xid N: why" (first one)."""
        nv, out = self._nv, dict[int, str]()
        for _ in range(_MAX_EVENTS_PER_POLL if self._set is not None else 0):
            try:
                event = nv.nvmlEventSetWait(self._set, 0)
            except Exception as exc:
                if not _is_nvml_error(nv, exc):
                    raise
                if getattr(exc, "value", None) != nv.NVML_ERROR_TIMEOUT:  # TIMEOUT: nothing (more) waiting
                    log.warning("reading Xid events failed: %s", exc)
                break
            xid, index = int(event.eventData), self._index_of(event.device)
            if xid not in FATAL_XIDS:
                log.info("Xid %d on GPU %s: an application's error, the GPU serves on", xid, index)
            elif index is None:
                log.error("Xid %d (%s) on a GPU NVML cannot name; nothing marked failed", xid, FATAL_XIDS[xid])
            else:
                log.error("GPU %d failed: Xid %d (%s)", index, xid, FATAL_XIDS[xid])
                out.setdefault(index, f"Xid {xid}: {FATAL_XIDS[xid]}")
        return out

    def close(self) -> None:
        """Free the event set and end its NVML session; again: nothing (NVML counts its sessions)."""
        event_set, self._set, self._by_handle, was_open, self._open = self._set, None, {}, self._open, False
        with contextlib.suppress(Exception):  # closing: nothing left to save
            if event_set is not None:
                self._nv.nvmlEventSetFree(event_set)
        if was_open:
            with contextlib.suppress(Exception):
                self._nv.nvmlShutdown()

    def _index_of(self, device: Any) -> int | None:
        try:
            return int(self._nv.nvmlDeviceGetIndex(device))
        except Exception as exc:  # a lost device may not answer: it is still the handle it registered with
            if not _is_nvml_error(self._nv, exc):
                raise
            return self._by_handle.get(_handle_key(device))


class _Lost(Exception):  # NVML said NVML_ERROR_GPU_IS_LOST about the device
    pass


def _device_health(nv: Any, index: int) -> GpuHealth:
    try:
        handle = _ask(nv, nv.nvmlDeviceGetHandleByIndex, index)
        if handle is None:
            return GpuHealth(index)
        temperature = _ask(nv, nv.nvmlDeviceGetTemperature, handle, nv.NVML_TEMPERATURE_GPU)
        ecc = _ask(
            nv, nv.nvmlDeviceGetTotalEccErrors, handle, nv.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, nv.NVML_VOLATILE_ECC
        )
    except _Lost:
        return GpuHealth(index, None, "device lost")
    failed = f"uncorrected ECC errors ({int(ecc)})" if ecc else ""
    return GpuHealth(index, None if temperature is None else float(temperature), failed)


def _ask(nv: Any, fn: Callable[..., Any], *args: Any) -> Any:
    """fn(*args); None where NVML cannot say (not supported, no permission); _Lost for a lost device."""
    try:
        return fn(*args)
    except Exception as exc:
        if not _is_nvml_error(nv, exc):
            raise
        if getattr(exc, "value", None) == nv.NVML_ERROR_GPU_IS_LOST:
            raise _Lost from None
        return None


def _handle_key(handle: Any) -> Any:
    """A device handle as a dict key: pynvml's are ctypes pointers, equal by address, not by ==."""
    return ctypes.cast(handle, ctypes.c_void_p).value if isinstance(handle, ctypes._Pointer) else handle


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
