"""Messages between node hosts and xds_server (JSON over the admin API).

A node host posts a heartbeat (POST /v1/nodes/heartbeat) every 0.5 s with its GPUs and every instance it
runs. xds_server answers with the complete set of instances the node should run. While xds_server is
still rebuilding its registry after a start (`authoritative` false), a node host changes nothing: it
keeps what runs, so a restarted control plane never tears the data plane down.

Specs travel once, not every half second. Every instance report and assignment names its spec by
`spec_digest` (sie.spec: SHA-256 of its canonical JSON); the spec itself rides along only where the other
side may not have it, and each distinct spec once per message:

- a report carries its spec unless the control plane has it: the last beat reported that instance
  with that digest and the reply did not ask for it again (`send_specs`), or an authoritative reply
  assigned it with that digest (a build the control plane holds). The control plane keeps what a
  node's last beat reported and its models' builds; a restarted one asks for the rest.
- an assignment carries its spec unless the node holds a spec with that digest (its heartbeat reported
  an instance with it) or an earlier assignment of the reply carries it.
- at most MAX_SPEC_BYTES_PER_BEAT of specs go either way in one message (the first whatever its size);
  the rest wait for the next (an assignment whose spec the node does not hold is started once a reply
  brings it).

A node may run MAX_INSTANCES instances (the control plane places MAX_PLACED_PER_NODE at most) and a spec
may have 256 KiB where it enters the cluster (sie.spec.MAX_SPEC_BYTES), so a heartbeat's size is bounded
whatever the specs, and a steady node sends and receives none. The control plane holds every sender to
that: a heartbeat over MAX_HEARTBEAT_BYTES is refused unread (413), and one with more specs than
spec_fits lets a beat carry, or an address that is not host:port, is a 400 naming the field
(NodeHeartbeat.from_json).

Node hosts and the control plane upgrade together: this wire has no version negotiation, and each side
refuses fields it does not know (sie.records.decode). A node host newer than its control plane has its
heartbeats refused; one older than it refuses the replies, and keeps what runs until it is upgraded.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from sie.errors import Problem, SpecError
from sie.records import bounds, cut, decode
from sie.spec import spec_figures, spec_size
from sie.telemetry import InstanceState, parse_port

HEARTBEAT_INTERVAL_S = 0.5


# Bounds of what one heartbeat may carry: generous for any real node, small enough that a bad one
# cannot make the control plane hold or serialise megabytes per node.
MAX_GPUS = 64
MAX_INSTANCES = 1024  # instance reports in one heartbeat (a worker and a sidecar process each)
# Instances the control plane places on one node at most (kubelet's maxPods is 110): half of what a
# heartbeat reports, the rest room for instances being stopped, refused, or handed over to another node.
MAX_PLACED_PER_NODE = MAX_INSTANCES // 2
MAX_VERSION = 64  # characters of a model version
MAX_DETAIL = 4096  # characters of an instance's detail (crash reasons, refusals)
MAX_UNPLACEABLE = 1024  # characters of why a node cannot run an instance
# A heartbeat's JSON at most: what a node host sends (NodeAgent._encoded) and the control plane reads
# (xds_server.admin refuses a larger body with 413 before reading it).
MAX_HEARTBEAT_BYTES = 16 * 1024 * 1024
# Specs one heartbeat (or reply) carries at most, as JSON bytes: with MAX_INSTANCES reports of ASCII texts
# (about 7.5 KiB each at most) a heartbeat stays under MAX_HEARTBEAT_BYTES. A node host whose beat would
# not (long non-ASCII details) sends it with every free text cut short (NodeAgent) instead.
MAX_SPEC_BYTES_PER_BEAT = 4 * 1024 * 1024


# The InstanceReport fields that name a listener as host:port.
ADDRESS_FIELDS = ("sidecar_address", "control_address", "worker_address")
_HOST_NAME = re.compile(r"[A-Za-z0-9]([A-Za-z0-9.-]{0,251}[A-Za-z0-9])?")  # ASCII letters and digits only
_MAX_PROBLEMS = 20  # as sie.records lists at most


def spec_fits(size: int, budget: int) -> bool:
    """Whether a spec of `size` bytes goes in a message with `budget` of MAX_SPEC_BYTES_PER_BEAT left:
    the first one always does, whatever its size, so no spec waits for ever."""
    return size <= budget or budget == MAX_SPEC_BYTES_PER_BEAT


class SpecDigests:
    """sie.spec's spec_digest and spec_size of the spec dicts a process holds, remembered by identity: a
    heartbeat and its reply name every instance's spec each half second, and the dicts behind them rarely
    change. Each dict is kept with its figures, so its id cannot be reused while remembered."""

    def __init__(self, limit: int = 4 * MAX_INSTANCES):
        self._held: dict[int, tuple[dict[str, Any], str, int]] = {}
        self._limit = limit

    def __call__(self, spec: dict[str, Any]) -> str:
        return self._figures(spec)[1]

    def size(self, spec: dict[str, Any]) -> int:
        return self._figures(spec)[2]

    def __len__(self) -> int:
        return len(self._held)

    def retain(self, specs: Iterable[dict[str, Any]]) -> None:
        """Forget every dict but these (the ones still held), so none is kept alive by this alone."""
        keep = {id(spec) for spec in specs}
        self._held = {key: held for key, held in self._held.items() if key in keep}

    def _figures(self, spec: dict[str, Any]) -> tuple[dict[str, Any], str, int]:
        held = self._held.get(id(spec))
        if held is not None and held[0] is spec:
            return held
        if len(self._held) >= self._limit:
            self._held.clear()
        held = self._held[id(spec)] = (spec, *spec_figures(spec))
        return held


@dataclass(frozen=True)
class GPUInfo:
    index: int = field(metadata=bounds(low=0, high=1024))
    name: str = field(metadata=bounds(max_len=128))
    total_mb: float = field(metadata=bounds(low=0, high=1e9))
    used_mb: float = field(metadata=bounds(low=0, high=1e9))
    utilization: float | None = field(default=None, metadata=bounds(low=0, high=1))  # None where unknown
    virtual: bool = False  # a --virtual-gpus stand-in, not a real device
    # The node host's ledger, for the control plane's placement (xds_server.placement). None from older
    # node hosts: placement then knows nothing of this GPU's memory and places by instance count.
    tier: str = field(default="", metadata=bounds(max_len=63))  # --gpu-tiers; "" for none
    reserved_mb: float | None = field(default=None, metadata=bounds(low=0, high=1e9))  # the ledger's level
    high_mb: float | None = field(default=None, metadata=bounds(low=0, high=1e9))  # its high watermark
    sleeping_mb: float | None = field(default=None, metadata=bounds(low=0, high=1e9))  # held by sleeping instances
    temperature_c: float | None = field(default=None, metadata=bounds(low=-100, high=300))  # NVML; None where unknown
    # Why the GPU is failed ("Xid 79: fallen off the bus", "uncorrected ECC errors", "device lost", or
    # "failed through the node host's API" on a virtual GPU); "" while healthy. Nothing is placed on a
    # failed GPU and its instances are placed elsewhere.
    failed: str = field(default="", metadata=bounds(max_len=512))


@dataclass(frozen=True)
class InstanceReport:
    instance_id: str = field(metadata=bounds(max_len=253))
    model_id: str = field(metadata=bounds(max_len=63))
    version: str = field(metadata=bounds(max_len=MAX_VERSION))
    state: InstanceState
    # ModelService.to_dict(), or None when the control plane has it already (see the module's docstring)
    spec: dict[str, Any] | None
    # host:port of the sidecar's data listener once it listens: the address EDS gets for this instance,
    # registered by its node host (never taken from telemetry).
    sidecar_address: str | None = field(default=None, metadata=bounds(max_len=300))
    control_address: str | None = field(default=None, metadata=bounds(max_len=300))  # the sidecar's control listener
    worker_address: str | None = field(default=None, metadata=bounds(max_len=300))
    gpu_index: int | None = field(default=None, metadata=bounds(low=0, high=1024))
    # The CPU cores its worker and sidecar may use, as a CPU list ("0", "2-3"), when the node host pins
    # them (its --tier-cpus: the tier's cores, or the shared pool); "" when not pinned: any of the node's.
    cpus: str = field(default="", metadata=bounds(max_len=1024))
    restarts: int = field(default=0, metadata=bounds(low=0, high=2**31))
    detail: str = field(default="", metadata=bounds(max_len=MAX_DETAIL))  # e.g. the last crash reason
    # What the node host's ledger holds for it, over its GPUs (MiB; None when not in the ledger): the
    # control plane learns a model's memory need from its running instances.
    reserved_mb: float | None = field(default=None, metadata=bounds(low=0, high=1e9))
    # Why this node cannot run it now ("" when it can): refused, short of memory with nothing it may
    # evict, or its GPU failed. The control plane then places it on another node where it fits.
    unplaceable: str = field(default="", metadata=bounds(max_len=MAX_UNPLACEABLE))
    # spec_digest(spec); the control plane computes it again from a spec that comes with the report
    spec_digest: str = field(default="", metadata=bounds(max_len=64))

    def fitted(self) -> InstanceReport:
        """This report with its free texts cut to what a heartbeat may carry: a long crash reason or
        refusal (a spec's every wrong field, a log's last words) must never make the node's whole
        heartbeat invalid, which would cut the node off from the control plane."""
        return dataclasses.replace(
            self,
            version=cut(self.version, MAX_VERSION),  # a refused spec's, as it came
            detail=cut(self.detail, MAX_DETAIL),
            unplaceable=cut(self.unplaceable, MAX_UNPLACEABLE),
        )


@dataclass(frozen=True)
class NodeHeartbeat:
    node: str = field(metadata=bounds(max_len=253))
    address: str = field(metadata=bounds(max_len=300))  # the node host's own API, http://host:port
    gpus: list[GPUInfo] = field(default_factory=list, metadata=bounds(max_items=MAX_GPUS))
    instances: list[InstanceReport] = field(default_factory=list, metadata=bounds(max_items=MAX_INSTANCES))
    facts: dict[str, str] = field(default_factory=dict, metadata=bounds(max_items=64))  # python, torch, cuda, ...
    # For the control plane's placement: the node's labels (a spec's scheduling.nodeSelector must match),
    # its taints as "key=value:Effect" (a spec's tolerations must tolerate each NoSchedule one), and the
    # GPU tiers only P0 models may use.
    labels: dict[str, str] = field(default_factory=dict, metadata=bounds(max_items=64))
    taints: list[str] = field(default_factory=list, metadata=bounds(max_items=64))
    p0_only_tiers: list[str] = field(default_factory=list, metadata=bounds(max_items=64))
    # Tiers with CPU cores reserved on this node (node host --tier-cpus): a tier's model that needs no
    # GPU (a scorer) may be placed here even where no GPU is of that tier.
    cpu_tiers: list[str] = field(default_factory=list, metadata=bounds(max_items=64))

    def to_json(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        for inst in out["instances"]:
            inst["state"] = InstanceState(inst["state"]).value
        return out

    @classmethod
    def from_json(cls, data: Any) -> NodeHeartbeat:
        """A heartbeat from parsed JSON; SpecError naming every field of the wrong type or size, specs past
        what spec_fits lets a beat carry, or an address that is not host:port. The specs are measured first: a beat of megabytes of them is refused for no more work
        than the bound, before they are decoded."""
        problems = _spec_problems(data)
        if not problems:
            beat = decode(cls, data, "node heartbeat")
            problems = _address_problems(beat.instances)
            if not problems:
                return beat
        raise SpecError("node heartbeat", problems)


def _spec_problems(data: Any) -> list[Problem]:
    """The heartbeat's specs held to the rule a node host sends them by (spec_fits, measured as it
    measures them, sie.spec.spec_size, in the order they come): while they fit in MAX_SPEC_BYTES_PER_BEAT,
    the first whatever its size. Not each to MAX_SPEC_BYTES: a spec admitted before that bound existed
    must not cut its node off; the body limit bounds the one a beat may carry past the budget. Reads the
    parsed JSON before it is decoded, no further than the first spec that breaks the rule; what is not
    where a spec goes is left to `decode`."""
    instances = data.get("instances") if isinstance(data, dict) else None
    if not isinstance(instances, list):
        return []
    budget = MAX_SPEC_BYTES_PER_BEAT
    for i, report in enumerate(instances[: MAX_INSTANCES + 1]):
        spec = report.get("spec") if isinstance(report, dict) else None
        if not isinstance(spec, dict):
            continue
        try:
            size = spec_size(spec)
        except (TypeError, ValueError):  # not plain JSON: decode names it
            continue
        if not spec_fits(size, budget):
            return [
                Problem(
                    f"instances[{i}].spec",
                    f"brings the beat's specs past {MAX_SPEC_BYTES_PER_BEAT} bytes of JSON; send the rest in the "
                    "next beats",
                )
            ]
        budget -= size
    return []


def _address_problems(reports: list[InstanceReport]) -> list[Problem]:
    problems = []
    for i, report in enumerate(reports):
        for name in ADDRESS_FIELDS:
            address = getattr(report, name)
            problem = None if address is None else host_port_problem(address)
            if problem is not None:
                problems.append(Problem(f"instances[{i}].{name}", problem))
                if len(problems) >= _MAX_PROBLEMS:
                    return problems
    return problems


def host_port_problem(address: str) -> str | None:
    """Why `address` is not HOST:PORT, or None: the host an IP literal (IPv6 in brackets) or a DNS name,
    the port ASCII digits 1..65535 (sie.telemetry.parse_port). A name passes here: whether EDS may take
    the address, which needs an IP literal, is the registry's call (sie.telemetry.address_problem), and
    refusing it here would refuse the node's every heartbeat, not just that address."""
    host, sep, port = address.rpartition(":")
    if not sep or not host:
        return f"{cut(address, 64)!r} is not host:port"
    if parse_port(port) is None:
        return f"{cut(address, 64)!r}: the port must be a number 1..65535"
    bracketed = host.startswith("[") and host.endswith("]")
    try:
        ipaddress.ip_address(host[1:-1] if bracketed else host)
    except ValueError:
        if bracketed or not _HOST_NAME.fullmatch(host):
            return f"{cut(address, 64)!r}: the host must be an IP address or a host name"
    return None


@dataclass(frozen=True)
class Assignment:
    instance_id: str = field(metadata=bounds(max_len=253))
    model_id: str = field(metadata=bounds(max_len=63))
    # ModelService.to_dict(), or None when the node holds a spec with this spec_digest (it reported one) or
    # an earlier assignment of the same reply carries it
    spec: dict[str, Any] | None
    # The instance's sidecar credential, signed by the control plane for exactly this instance, model and
    # node: the node host hands it to the sidecar, which presents it with its telemetry.
    token: str = field(default="", metadata=bounds(max_len=4096))
    # False: the instance belongs to its model's warm pool (or is the one a model at zero keeps): the
    # node host loads it and keeps it asleep; its sidecar holds requests and wakes it when one arrives.
    awake: bool = True
    spec_digest: str = field(default="", metadata=bounds(max_len=64))  # spec_digest(spec)

    @property
    def full_spec(self) -> dict[str, Any]:
        """The spec, on a node host that has filled in what the control plane left out (NodeAgent)."""
        if self.spec is None:
            raise ValueError(f"assignment {self.instance_id} came without its spec")
        return self.spec


@dataclass(frozen=True)
class HeartbeatReply:
    authoritative: bool  # False while xds_server is still rebuilding its registry: change nothing
    assignments: list[Assignment] = field(default_factory=list)
    # The node's own SIE credential (short-lived, renewed in every reply), which it presents to its
    # sidecars; on Kubernetes its service-account token proves it to the control plane only.
    node_token: str = field(default="", metadata=bounds(max_len=4096))
    # Instances whose reports came without a spec the control plane knows: the next heartbeat carries them.
    send_specs: list[str] = field(default_factory=list, metadata=bounds(max_items=MAX_INSTANCES))

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, data: Any) -> HeartbeatReply:
        return decode(cls, data, "heartbeat reply")
