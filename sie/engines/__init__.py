"""Engine dialects: how SIE talks to each engine it runs (sie.engines.dialect says what a dialect is).

    dialect_for(backend)   the Dialect of a backend type

One module per engine: `sie_protocol` (SIE's own torch, sklearn and sim engines), `sglang`, `vllm`,
`triton`. Adding an engine is one module here, its launch under node_host/backends/<engine>_server/,
and its tests. Pure: nothing here does I/O.
"""

from __future__ import annotations

from sie.engines.dialect import Call, Dialect, InferCodec, MemoryRelease, Sleep
from sie.engines.sglang import SGLANG
from sie.engines.sie_protocol import SIE
from sie.engines.triton import TRITON
from sie.engines.vllm import VLLM
from sie.spec import BackendType

__all__ = ["Call", "Dialect", "InferCodec", "MemoryRelease", "Sleep", "dialect_for"]

_BY_BACKEND = {
    BackendType.SGLANG: SGLANG,
    BackendType.VLLM: VLLM,
    BackendType.TRITON: TRITON,
    BackendType.TORCH: SIE,
    BackendType.SKLEARN: SIE,
    BackendType.SIM: SIE,
}


def dialect_for(backend: BackendType) -> Dialect:
    return _BY_BACKEND[backend]
