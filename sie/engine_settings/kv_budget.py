"""The KV-budget scale: a backend.config key the node host writes after a worker was OOM-killed
repeatedly (node_host.supervisor), and every engine that keeps a KV-cache budget (torch, SGLang, the
simulator) multiplies its budget by, leaving the rest of its memory as headroom."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from sie.engine_settings.fields import shown

KV_BUDGET_SCALE = "kv_budget_scale"


def kv_budget_scale(config: Mapping[str, Any] | None) -> float:
    """The scale backend.config asks for (1.0 when absent); ValueError naming the key when it is not a
    fraction in (0, 1]."""
    value = (config or {}).get(KV_BUDGET_SCALE, 1.0)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 < value <= 1.0:
        raise ValueError(f"backend.config.{KV_BUDGET_SCALE} must be a fraction in (0, 1], got {shown(value)}")
    return float(value)


def scaled_kv_tokens(tokens: int, scale: float, floor: int = 2) -> int:
    """A KV-token budget times the scale, never below `floor`."""
    return max(floor, int(tokens * scale))
