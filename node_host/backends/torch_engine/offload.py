"""Sleep and wake for a torch module: every parameter and buffer to host memory and back, measured.

Why not `module.to("cpu")` and back: on CUDA it leaves the host tensors pageable, so the wake copies at
pageable speed, one tensor at a time; on CPU it does nothing at all, so a "sleep" would claim a release
that did not happen. Here one code path serves both devices:

  release  each tensor the module owns (once per tensor object: tied weights share one Parameter) is
           copied into one flat host buffer, pinned when the module is on CUDA (the wake's copy is then
           one DMA at link speed), plain RAM on CPU. Then each tensor's `.data` is pointed at an empty
           tensor on its device, which drops its storage. Assigning `.data` changes the tensor object in
           place, so every alias of it (lm_head and embed_tokens, a rotary embedding's attributes) sees
           the change, and the module object, its hooks and its config stay as they are: nothing is
           rebuilt and nothing is read from disk on the way back. On CUDA, gc and empty_cache() then hand
           the freed blocks (weights, and whatever the caller freed before, e.g. the KV cache) back to
           the driver, so NVML sees them go.
  resume   one flat device buffer is allocated and filled with one copy (non_blocking from pinned
           memory, then synchronize); each tensor's `.data` becomes a view into it at its offset, with
           its shape and dtype (offsets aligned to ALIGN bytes, as the CUDA allocator aligns). The host
           copy is dropped, so an awake module holds no second copy.

Accounting (`Move`, one per release or resume), honest on both devices:
  * bytes_moved: the tensors' bytes (the sum of their nbytes); host_copy_bytes: the host buffer held
    after the step (the same plus alignment padding after a release, 0 after a resume);
  * on CUDA, device_allocated/reserved are torch.cuda.memory_allocated/memory_reserved of the device,
    before and after; device_freed_bytes is reserved before less after (negative for a resume: taken);
  * on CPU the device is the host (host_is_device): the weights only move between two buffers in the
    same RAM, so device_allocated counts the weights' bytes wherever they sit (the module's tensors
    plus the host copy), and device_freed_bytes is 0 for a release and for a resume.

Tensors are moved per object: two distinct tensors that are views of one storage would come back as two
copies (Hugging Face models do not do that; tying shares the Parameter itself). After a resume every
tensor is a view of one buffer, which serving does not mind (save_pretrained would refuse shared storage). Not thread-safe: used
only by the thread that owns the module. Pinned blocks come from torch's caching host allocator, which
rounds a request up to a power of two and keeps freed blocks for the next sleep of the same process.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import torch

from sie.errors import SIEError

ALIGN = 512  # bytes; what the CUDA caching allocator guarantees, more than any kernel asks for
MB = 1e6


class OffloadError(SIEError, RuntimeError):
    """A release or resume asked of a module in the wrong state, or one spread over several devices."""


@dataclass(frozen=True)
class _Slot:
    tensor: torch.Tensor  # the module's own tensor object (a Parameter or a buffer)
    offset: int  # in the flat buffers, bytes
    nbytes: int
    shape: torch.Size
    dtype: torch.dtype


@dataclass(frozen=True)
class Move:
    """The figures of one release or resume (see the module docstring for what each counts)."""

    kind: str  # "release" or "resume"
    device: str
    host_is_device: bool
    pinned: bool
    seconds: float
    tensors: int
    bytes_moved: int
    host_copy_bytes: int
    module_device_bytes_before: int  # the module's tensors on its device
    module_device_bytes_after: int
    device_allocated_before: int
    device_allocated_after: int
    device_reserved_before: int
    device_reserved_after: int

    @property
    def device_freed_bytes(self) -> int:
        return self.device_reserved_before - self.device_reserved_after

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        out["device_freed_bytes"] = self.device_freed_bytes
        if self.host_is_device:
            out["note"] = "the device is the host: the weights moved between two buffers in RAM; nothing is freed"
        return out

    def line(self) -> str:
        """One log line with the figures."""
        where = "the device is the host, nothing freed" if self.host_is_device else "pinned host copy"
        return (
            f"{self.kind} on {self.device}: {self.bytes_moved / MB:.1f} MB in {self.tensors} tensors moved in "
            f"{self.seconds * 1000:.1f} ms; device allocated {self.device_allocated_before / MB:.1f} -> "
            f"{self.device_allocated_after / MB:.1f} MB, reserved {self.device_reserved_before / MB:.1f} -> "
            f"{self.device_reserved_after / MB:.1f} MB, freed {self.device_freed_bytes / MB:.1f} MB; "
            f"host copy {self.host_copy_bytes / MB:.1f} MB ({where if self.host_copy_bytes else 'dropped'})"
        )


def module_tensors(module: torch.nn.Module) -> list[torch.Tensor]:
    """Every parameter and buffer of `module`, each tensor object once, in a stable order."""
    seen: dict[int, torch.Tensor] = {}
    for tensor in [*module.parameters(), *module.buffers()]:
        seen.setdefault(id(tensor), tensor)
    return list(seen.values())


def device_bytes(module: torch.nn.Module) -> int:
    """Bytes the module's tensors hold on their device now (0 while released)."""
    return sum(t.nbytes for t in module_tensors(module))


class Offload:
    """The weights of one module, released to host memory and resumed from it (see the module docstring).
    `clock` is seconds (perf_counter); it times each move."""

    def __init__(self, module: torch.nn.Module, *, clock: Callable[[], float] = time.perf_counter):
        self._module = module
        self._clock = clock
        self._slots: tuple[_Slot, ...] = ()
        self._host: torch.Tensor | None = None  # the flat uint8 host copy while released
        self._device: torch.device | None = None

    @property
    def released(self) -> bool:
        return self._host is not None

    def release(self) -> Move:
        if self._host is not None:
            raise OffloadError("the module is already released; resume it first")
        tensors = module_tensors(self._module)
        device = _device_of(tensors)
        cuda = device.type == "cuda"
        slots, total = _layout(tensors)
        before = self._memory(device, 0)
        start = self._clock()
        host = torch.empty(total, dtype=torch.uint8, pin_memory=cuda)
        for slot in slots:
            _view(host, slot).copy_(slot.tensor.detach(), non_blocking=cuda)
        if cuda:
            torch.cuda.synchronize(device)  # the host copy is complete before the device copy goes
        for slot in slots:
            slot.tensor.data = torch.empty(0, dtype=slot.dtype, device=device)
        self._slots, self._host, self._device = slots, host, device
        _free(device)
        seconds = self._clock() - start
        return self._move("release", device, before, seconds, cuda)

    def resume(self) -> Move:
        host, device = self._host, self._device
        if host is None or device is None:
            raise OffloadError("the module is not released; nothing to resume")
        cuda = device.type == "cuda"
        before = self._memory(device, self._payload())
        start = self._clock()
        flat = torch.empty(host.numel(), dtype=torch.uint8, device=device)
        flat.copy_(host, non_blocking=cuda)
        if cuda:
            torch.cuda.synchronize(device)  # the weights are on the device before anyone uses them
        for slot in self._slots:
            slot.tensor.data = _view(flat, slot)
        self._host = None
        del host
        seconds = self._clock() - start
        return self._move("resume", device, before, seconds, cuda)

    # ---- accounting -------------------------------------------------------------------------------

    def _payload(self) -> int:
        return sum(s.nbytes for s in self._slots)

    def _memory(self, device: torch.device, host_payload: int) -> tuple[int, int, int]:
        """(module bytes on the device, device allocated, device reserved) now."""
        module = device_bytes(self._module)
        if device.type == "cuda":
            return module, torch.cuda.memory_allocated(device), torch.cuda.memory_reserved(device)
        held = module + host_payload  # one RAM: the weights count once wherever they sit
        return module, held, held

    def _move(self, kind: str, device: torch.device, before: tuple[int, int, int], seconds: float, cuda: bool) -> Move:
        host_bytes = 0 if self._host is None else self._host.numel()
        after = self._memory(device, self._payload() if self._host is not None else 0)
        return Move(
            kind=kind,
            device=str(device),
            host_is_device=not cuda,
            pinned=cuda,
            seconds=seconds,
            tensors=len(self._slots),
            bytes_moved=self._payload(),
            host_copy_bytes=host_bytes,
            module_device_bytes_before=before[0],
            module_device_bytes_after=after[0],
            device_allocated_before=before[1],
            device_allocated_after=after[1],
            device_reserved_before=before[2],
            device_reserved_after=after[2],
        )


def _device_of(tensors: list[torch.Tensor]) -> torch.device:
    devices = {t.device for t in tensors}
    if len(devices) != 1:
        raise OffloadError(f"the module's tensors are on {sorted(map(str, devices))}; one device is supported")
    return devices.pop()


def _layout(tensors: list[torch.Tensor]) -> tuple[tuple[_Slot, ...], int]:
    slots, offset = [], 0
    for tensor in tensors:
        slots.append(_Slot(tensor, offset, tensor.nbytes, tensor.shape, tensor.dtype))
        offset += -(-tensor.nbytes // ALIGN) * ALIGN
    return tuple(slots), offset


def _view(flat: torch.Tensor, slot: _Slot) -> torch.Tensor:
    return flat[slot.offset : slot.offset + slot.nbytes].view(slot.dtype).view(slot.shape)


def _free(device: torch.device) -> None:
    """Hand freed device memory back to the driver. On CPU there is nothing to hand back (the weights
    stay in RAM), and a full gc costs hundreds of ms in a process that has imported transformers, so it
    runs only where it frees device memory."""
    if device.type == "cuda":
        gc.collect()  # cycles that still hold device tensors (a dropped KV cache, a traceback)
        torch.cuda.empty_cache()
