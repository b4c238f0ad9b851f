"""Fixtures shared by the node_host unit tests."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """The tiny random Qwen2 demo model, built once per test session (a few seconds on two cores)."""
    pytest.importorskip("transformers")
    from node_host.backends.torch_engine.demo_model import ensure_tiny_qwen2

    return ensure_tiny_qwen2(tmp_path_factory.mktemp("models") / "tiny")
