"""GPU utilisation and memory of the instance's GPU, from NVML.

A `GpuReader` is injected into the telemetry loop: `NvmlReader` on a machine with NVIDIA drivers,
nothing at all (None) elsewhere, so the record carries None (absent) and never a made-up zero.
NVML calls block for up to a few milliseconds, so the caller runs `read()` in a worker thread.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Protocol

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class GpuSample:
    utilization: float | None  # 0..1
    memory_used_mb: float | None
    memory_total_mb: float | None


class GpuReader(Protocol):
    def read(self) -> GpuSample | None: ...

    def close(self) -> None: ...


class NvmlReader:
    """Reads one GPU through pynvml (nvidia-ml-py). Build it with `open_nvml`."""

    def __init__(self, nvml: Any, handle: Any, index: int):
        self._nvml = nvml
        self._handle = handle
        self._index = index
        self._failed_once = False

    def read(self) -> GpuSample | None:
        nvml = self._nvml
        try:
            util = nvml.nvmlDeviceGetUtilizationRates(self._handle)
            mem = nvml.nvmlDeviceGetMemoryInfo(self._handle)
        except Exception as exc:  # noqa: BLE001 - pynvml raises NVMLError subclasses per cause
            # A GPU that fell off the bus or a driver reload: report absent, and say so once.
            if not self._failed_once:
                log.warning("NVML read of GPU %d failed (%s); GPU figures will be absent", self._index, exc)
                self._failed_once = True
            return None
        self._failed_once = False
        return GpuSample(util.gpu / 100.0, mem.used / 2**20, mem.total / 2**20)

    def close(self) -> None:
        try:
            self._nvml.nvmlShutdown()
        except Exception:  # noqa: BLE001 - shutting down a library that may already be gone
            pass


def open_nvml(index: int, nvml: Any = None) -> NvmlReader | None:
    """An NvmlReader for GPU `index`, or None (logged) when NVML cannot be initialised there."""
    if nvml is None:
        try:
            import pynvml  # noqa: PLC0415 - optional at runtime, only on GPU nodes
        except ImportError:
            log.warning("pynvml is not installed (pip install nvidia-ml-py); GPU figures will be absent")
            return None
        nvml = pynvml
    try:
        nvml.nvmlInit()
    except Exception as exc:  # noqa: BLE001 - NVMLError_LibraryNotFound, DriverNotLoaded, ...
        log.warning("NVML is not available (%s); GPU figures will be absent", exc)
        return None
    try:
        handle = nvml.nvmlDeviceGetHandleByIndex(index)
    except Exception as exc:  # noqa: BLE001
        count = _device_count(nvml)
        log.warning("GPU %d is not visible to NVML (%s; %s GPUs found); GPU figures will be absent", index, exc, count)
        nvml.nvmlShutdown()
        return None
    return NvmlReader(nvml, handle, index)


def _device_count(nvml: Any) -> str:
    try:
        return str(nvml.nvmlDeviceGetCount())
    except Exception:  # noqa: BLE001
        return "unknown"
