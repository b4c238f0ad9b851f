"""Where the tests find the real engines SIE runs as they are (vLLM's CPU build, Triton), installed by
`scripts/install-engines` in their own virtual environments: $SIE_ENGINES_DIR, else the checkout's
.sie/engines (node_host.engines reads the same directory).

A test that needs an engine calls `require(...)`: where the engine is missing it is skipped with the
install line, except in CI (CI=true), where .ci/run has installed them and a missing engine is a failure,
never a silent skip.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from node_host.engines import Engines, find_engines

REPO = Path(__file__).resolve().parents[1]


def engines_dir() -> Path:
    return Path(os.environ.get("SIE_ENGINES_DIR") or REPO / ".sie" / "engines").absolute()


def require(engine: str) -> Engines:
    """The engines found; skips (or fails, in CI) when `engine` ("vllm" or "triton") is not among them."""
    found = find_engines(engines_dir())
    have = found.vllm_python if engine == "vllm" else found.triton_venv
    if have is None:
        why = f"no {engine} engine in {engines_dir()}: run scripts/install-engines (or set SIE_ENGINES_DIR)"
        if os.environ.get("CI") == "true":
            pytest.fail(why)
        pytest.skip(why)
    return found
