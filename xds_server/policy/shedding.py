"""Load shedding for one model (pure): how much of its new traffic Envoy drops with a 503.

Envoy applies it through EDS `policy.drop_overloads`; a dropped request gets a 503 at once, which is
better for the client than a timeout and protects the requests that are admitted.

    overload L = the saturation of the LEAST saturated fresh, serving endpoint (every one is at least this
                 loaded, so moving traffic between them cannot help)
    threshold  = shed_start_p2 for P2 models, shed_start_p1 for P1 (higher: P2 sheds first, P1 only under
                 a deeper overload), none for P0: a P0 model never sheds, whatever the load
    shedding starts once L >= threshold has lasted shed_after_s, then integrates:
        drop += shed_gain * (L - threshold) per step_s, within [0, max_drop_percent]
    so it grows while the overload lasts, settles where the admitted load holds L at the threshold, and
    falls back to 0 once L stays below it. With no fresh telemetry at all nothing new is shed (we cannot
    tell overload from an outage) and any drop decays.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from sie.spec import ModelService, Priority
from xds_server.policy.settings import WeightSettings
from xds_server.policy.signals import EndpointSignals


@dataclass(frozen=True)
class Shed:
    percent: float  # the integrator's value, kept in the state
    published: float  # what goes into the decision: rounded, 0 below half a percent
    overloaded_since: float | None
    reason: str


def threshold(priority: Priority, s: WeightSettings) -> float:
    """The overload at which a model of this priority starts shedding; inf for P0 (never)."""
    return {Priority.P2: s.shed_start_p2, Priority.P1: s.shed_start_p1}.get(priority, math.inf)


def next_drop(
    model: ModelService,
    serving: Sequence[EndpointSignals],
    percent: float,
    overloaded_since: float | None,
    now: float,
    dt: float,
    s: WeightSettings,
) -> Shed:
    priority = model.spec.model.priority_level
    start = threshold(priority, s)
    if math.isinf(start):
        return Shed(0.0, 0.0, None, "")
    fresh = [sig.saturation for sig in serving if not sig.stale]
    steps = dt / s.step_s
    if not fresh:
        percent = max(0.0, percent - s.shed_gain * steps)
        why = f"shedding {priority.value} {_rounded(percent):g}% (no fresh telemetry)" if percent else ""
        return Shed(percent, _rounded(percent), None, why)
    overload = min(fresh)
    if overload >= start:
        overloaded_since = now if overloaded_since is None else overloaded_since
    else:
        overloaded_since = None
    sustained = overloaded_since is not None and now - overloaded_since >= s.shed_after_s
    if percent > 0 or sustained:
        percent = min(s.max_drop_percent, max(0.0, percent + s.shed_gain * (overload - start) * steps))
    published = _rounded(percent)
    reason = ""
    if published:
        reason = f"shedding {priority.value} {published:g}% (overload {overload:.2f}, threshold {start:g})"
    elif overloaded_since is not None:
        reason = f"overload {overload:.2f} for {now - overloaded_since:.1f}s"
    return Shed(percent, published, overloaded_since, reason)


def _rounded(percent: float) -> float:
    return 0.0 if percent < 0.5 else round(percent, 1)
