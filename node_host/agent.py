"""The node host's loops: heartbeat to the control plane, admission of new instances under the GPU
memory ledger, supervision ticks, and memory pressure.

Every heartbeat interval (node_host.settings.NodeTunables) the node host probes its instances (the
worker's /health, the sidecar's /-/state), folds what it saw into the ledger (an instance that answers
ready is LOADED, its demand and last use are noted), posts a sie.wire.NodeHeartbeat (GPUs, facts, every
instance, its spec named by digest once the control plane has it: sie.wire) to
CONTROL_URL/v1/nodes/heartbeat and applies the reply, but only when it
is `authoritative`: a control plane that is still rebuilding its registry never tears the data plane
down. When the control plane cannot be reached, everything keeps running and the next heartbeat retries.

A new assignment is not started at once: it is pending until the GPUManager admits it (highest
priority first, then oldest). Admission either places it (its memory reserved, one load at a time per
GPU), has Pressure evict lower-priority instances first, keeps it waiting with the reason in its
report (`loading` while waiting for another load, `failed` while memory is short), or refuses it for
good (`failed`, "refused: ..."; a 409 in the ledger's terms: tier, requirements, too large; a spec that
does not parse, engine settings included (sie.engine_settings); or what only the worker would refuse,
a missing model path or a simulator parameter, backends/registry.check_engine_settings). A start the
machine refuses (no disk for its files, no file descriptors: OSError) gives its memory back and waits
START_RETRY_S before it is admitted again, reported `failed` with the reason meanwhile.

A sidecar's /-/state is read as the control plane reads it (sie.telemetry.TelemetryRecord: every field's
type and bound) and must be its own instance's; a reply that is not is a failed probe of that instance
(logged once per reason), never an error of the heartbeat. A sidecar is asked only while its process
runs: the request carries the node's token, and while the sidecar is down another process of this host
may listen on its port.

The HTTP API is in api.py.
"""

from __future__ import annotations

import asyncio
import dataclasses
import io
import json
import logging
import time
from collections.abc import Awaitable, Callable, Coroutine, Mapping
from dataclasses import dataclass
from typing import Any

import aiohttp

from node_host import assignments, reports
from node_host.backends.registry import check_engine_settings
from node_host.gpu_manager import Evict, GPUManager, OffGPU, Placed, Refuse, Wait
from node_host.ledger import EntryState
from node_host.pressure import EventLog, Pressure
from node_host.settings import AgentSettings, EvictionMode
from node_host.sidecar_control import HttpSidecarControl, SidecarControl
from node_host.supervisor import Instance, ProcessManager
from sie.auth import IssuedToken, TokenSource
from sie.errors import SpecError
from sie.records import cut
from sie.spec import ModelService
from sie.spec_loader import parse_model_service
from sie.tasks import Policy, SupervisedTasks
from sie.telemetry import InstanceState, TelemetryRecord
from sie.wire import (
    MAX_HEARTBEAT_BYTES,
    MAX_INSTANCES,
    MAX_SPEC_BYTES_PER_BEAT,
    Assignment,
    GPUInfo,
    HeartbeatReply,
    InstanceReport,
    NodeHeartbeat,
    SpecDigests,
    spec_fits,
)

log = logging.getLogger(__name__)

SHORT_TEXT = 256  # characters of a report's detail and unplaceable in a heartbeat too large otherwise

# A held request woke an instance the control plane keeps asleep: how long it stays awake before the
# node host follows the (by then stale) assignment again, should the control plane not ask for it.
WOKEN_FOR_REQUEST_GRACE_S = 10.0

# A start that failed for want of a resource of the machine (disk, file descriptors) is tried again
# after this long: soon enough for a freed disk, rare enough not to churn the ledger every tick.
START_RETRY_S = 10.0

# Measures the GPU memory of workers, by pid: {pid: {gpu index: MiB}}. None on virtual GPUs.
Measure = Callable[[list[int]], Awaitable[Mapping[int, Mapping[int, float]]]]


@dataclass(frozen=True)
class Refused:
    """An assignment this node cannot run; kept so it is reported and not retried every heartbeat."""

    assignment: Assignment
    reason: str


@dataclass
class Pending:
    """An assignment waiting for admission, with why it waits (shown in its report)."""

    assignment: Assignment
    service: ModelService
    since: float
    state: InstanceState = InstanceState.LOADING
    reason: str = "waiting for admission"
    retry_at: float = float("-inf")  # not admitted before (its last start failed: START_RETRY_S)


def sidecar_record(instance_id: str, body: Any) -> tuple[dict[str, Any] | None, str]:
    """A sidecar's /-/state body as the control plane reads it (every field's type and bound) if it is
    `instance_id`'s record: (the record as JSON, ""), else (None, why not)."""
    try:
        record = TelemetryRecord.from_json(body)
    except SpecError as exc:
        return None, cut("; ".join(str(problem) for problem in exc.problems), SHORT_TEXT)
    if record.instance_id != instance_id:
        return None, f"it is the record of instance {cut(record.instance_id, 64)!r}"
    return record.to_json(), ""


class NodeAgent:
    def __init__(
        self,
        settings: AgentSettings,
        supervisor: ProcessManager,
        session: aiohttp.ClientSession,
        *,
        credential: TokenSource,
        gpus: Callable[[], Awaitable[list[GPUInfo]]],
        facts: dict[str, str],
        manager: GPUManager | None = None,
        control: SidecarControl | None = None,
        measure: Measure | None = None,
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
        tasks: SupervisedTasks | None = None,
    ):
        self.settings = settings
        self.supervisor = supervisor
        self._session = session
        # This node's identity, to the control plane (heartbeats) and to its own sidecars: the node token
        # each heartbeat reply renews, and `credential` (its token file, or on Kubernetes its
        # service-account token) until the first reply and whenever the control plane refuses the renewed
        # one (a control plane with a new key). So the file's token crosses the network once per start,
        # and what a heartbeat shows after that expires within the hour (xds_server.credentials).
        self.node_credential = IssuedToken(credential)
        self._gpus = gpus
        self.gpus_seen: list[GPUInfo] = []  # the GPUs as the last heartbeat read them (node_host/metrics.py)
        self.facts = facts
        self.manager = manager or GPUManager([], facts=facts)
        self.control = control or HttpSidecarControl(
            session, self.node_credential, probe_timeout_s=settings.tunables.probe_timeout_s
        )
        self._measure = measure
        self._clock = clock
        self.events = EventLog(wall)
        self.pressure = Pressure(
            self.manager,
            supervisor,
            self.control,
            self.events,
            spawn=self.spawn_task,
            mode=settings.tunables.eviction,
            drain_timeout_s=settings.tunables.drain_timeout_s,
            wake_timeout_s=settings.tunables.wake_timeout_s,
            retry_after_s=settings.tunables.eviction_retry_s,
            clock=clock,
            wall=wall,
        )
        self.address = ""  # http://host:port of the API, set once it listens
        self.refused: dict[str, Refused] = {}
        self.pending: dict[str, Pending] = {}
        self.reachable: bool | None = None  # None until the first heartbeat
        self._health: dict[str, str | None] = {}
        self.sidecar_states: dict[str, dict[str, Any] | None] = {}  # valid records only (sidecar_record)
        self._bad_states: dict[str, str] = {}  # instance id -> why its last /-/state was not read (logged once)
        self._answered: dict[str, int] = {}  # instance id -> requests_total last seen (for last use)
        self.tasks = tasks or SupervisedTasks()  # the owner's on_fatal stops the node host
        # The fleet's shape (Assignment.awake): instances the control plane keeps asleep, those this node
        # put to sleep for it (only those wake when it wants them again; evicted ones are Pressure's), and
        # those a held request woke (not put back to sleep until the control plane has seen the demand).
        self.kept_asleep: set[str] = set()
        self.fleet_asleep: set[str] = set()
        self.woken_for_request: dict[str, float] = {}
        self._stops: dict[str, asyncio.Task] = {}
        # Which specs the control plane has (sie.wire): (instance id, spec digest) of what the last beat
        # reported and its reply did not ask for, and of the reply's assignments. A report carries its
        # spec only where the control plane may not have it.
        self._digest = SpecDigests()
        self._control_has: set[tuple[str, str]] = set()

    # ---- tasks ------------------------------------------------------------------------------------

    def spawn_task(self, coro: Coroutine[Any, Any, Any], name: str) -> asyncio.Task:
        """One-shot work (stopping an instance, an eviction, a wake): a failure is logged, nothing more."""
        return self.tasks.start(name, Policy.LOG, lambda: coro, forever=False)

    def loops(self) -> list[asyncio.Task]:
        """Start the heartbeat and supervision loops; they run until cancelled. Each round's failure is
        retried by `_every`; the loop itself ending is fatal (the owner stops the node host)."""
        heartbeat, tick = self.settings.tunables.heartbeat_interval_s, self.settings.tunables.tick_interval_s
        return [
            self.tasks.start("heartbeat", Policy.FATAL, lambda: self._every(heartbeat, self.heartbeat_once)),
            self.tasks.start("supervise", Policy.FATAL, lambda: self._every(tick, self.tick)),
        ]

    async def _every(self, interval_s: float, fn: Callable[[], Awaitable[Any]]) -> None:
        """Run fn forever. A failing round is logged and the loop goes on: a bug in one heartbeat must
        not take the node's instances down with the node host."""
        while True:
            try:
                await fn()
            except Exception:
                task = asyncio.current_task()
                log.exception("%s failed; retrying in %.1f s", task.get_name() if task else "a loop", interval_s)
            await asyncio.sleep(interval_s)

    async def tick(self) -> None:
        self.supervisor.tick(asleep=self._asleep)
        await self._check_loads()
        self.admit_pending()
        self.pressure.step(starved=self._starved, kept_asleep=lambda iid: iid in self.fleet_asleep)
        self._follow_shape()

    def _follow_shape(self) -> None:
        """One step towards the fleet's shape: sleep an awake instance the control plane keeps asleep,
        or wake one this node put to sleep for it that it wants serving again (one memory operation at
        a time, as for evictions). An instance a held request woke stays awake for
        WOKEN_FOR_REQUEST_GRACE_S, or until the control plane wants it awake: it has seen the demand."""
        if not self.pressure.ready:
            return
        now = self._clock()
        for iid, inst in sorted(self.supervisor.instances.items()):
            if inst.stopping:
                continue
            state = self.manager.state_of(iid)
            if iid in self.kept_asleep:
                woken = self.woken_for_request.get(iid)
                if woken is not None and now - woken < WOKEN_FOR_REQUEST_GRACE_S:
                    continue
                sidecar = (self.sidecar_states.get(iid) or {}).get("state")
                loaded = state is EntryState.LOADED or not self.manager.holds(iid)  # off the ledger: CPU, sim
                if iid not in self.fleet_asleep and loaded and sidecar == InstanceState.READY.value:
                    if self.pressure.sleep_for_fleet(
                        iid, f"the control plane keeps it asleep ({inst.service.model_id})"
                    ):
                        self.fleet_asleep.add(iid)
                        self.woken_for_request.pop(iid, None)
                        return
            else:
                self.woken_for_request.pop(iid, None)
                on_ledger = self.manager.holds(iid)
                if iid in self.fleet_asleep and (state is EntryState.SLEEPING or not on_ledger):
                    if self.pressure.wake(iid, "the control plane wants it serving (scaled up)"):
                        self.fleet_asleep.discard(iid)
                        if on_ledger:
                            return  # one memory operation at a time; off the GPU nothing is shared

    def fail_gpu(self, index: int, reason: str) -> list[str]:
        """GPU `index` failed: nothing is placed on it again (until the node host restarts), and every
        instance on it stops. Its worker is killed at once, as the failure would have done (the sidecar
        answers its in-flight requests 503 worker_lost, retryable, so Envoy retries them elsewhere); then
        sidecar and worker stop. The control plane still assigns it here, so the next heartbeat queues it
        again: admission puts it on a healthy GPU that has room, or reports it `unplaceable` and the
        control plane places it on another node. Returns the instances that were on the GPU."""
        victims = list(self.manager.fail_gpu(index, reason))
        self.events.add("gpu_failed", "", gpu=index, reason=reason, instances=victims)
        for iid in victims:
            inst = self.supervisor.instances.get(iid)
            if inst is None or inst.stopping:
                self.manager.release(iid)
                continue
            self.supervisor.park_worker(iid, f"its GPU {index} failed ({reason})")
            if iid not in self._stops:
                self._stops[iid] = self.spawn_task(self._stop(iid), f"stop:{iid}")
        return victims

    async def wake_for_request(self, instance_id: str) -> str | None:
        """A request is held at the instance's sidecar: wake it now. None once it serves, else why not."""
        inst = self.supervisor.instances.get(instance_id)
        if inst is None:
            return f"no instance {instance_id} on node {self.settings.node}"
        timeout = min(self.settings.tunables.wake_timeout_s, inst.service.spec.autoscale.wake_timeout_s)
        # Ours from here: the fleet's own wake (_follow_shape) must not start a second one meanwhile.
        was_fleet_asleep = instance_id in self.fleet_asleep
        self.fleet_asleep.discard(instance_id)
        self.woken_for_request[instance_id] = self._clock()
        why = await self.pressure.wake_now(instance_id, "a request is waiting for it", timeout)
        if why is not None and was_fleet_asleep:
            self.fleet_asleep.add(instance_id)
            self.woken_for_request.pop(instance_id, None)
        if why is None:
            self.woken_for_request[instance_id] = self._clock()
            self.events.add("woken_for_request", instance_id)
        return why

    async def shutdown(self) -> None:
        """Stop the loops, then every instance (sidecars first); leaves no child process."""
        await self.tasks.stop()
        await self.supervisor.stop_all()

    # ---- heartbeat --------------------------------------------------------------------------------

    def _beat(self, gpus: list[GPUInfo], instances: list[InstanceReport]) -> NodeHeartbeat:
        return NodeHeartbeat(
            node=self.settings.node,
            address=self.address,
            gpus=gpus,
            instances=instances,
            facts=self.facts,
            labels=dict(self.settings.labels),
            taints=list(self.settings.taints),
            p0_only_tiers=sorted(self.manager.p0_only_tiers),
            cpu_tiers=list(self.settings.cpu_tiers),
        )

    def heartbeat_problem(self) -> str | None:
        """Why the control plane would refuse every heartbeat of this node, whatever it runs (its name,
        address, GPUs, labels, taints, tiers: what it started with, held to the same bounds the control
        plane reads a heartbeat with), or None. The node host checks this once before its first beat:
        such a node would otherwise run cut off, its instances never routed, with only a warning."""
        beat = self._beat(self.manager.gpu_infos(), [])
        try:
            NodeHeartbeat.from_json(json.loads(json.dumps(beat.to_json())))
        except SpecError as exc:
            return str(exc)
        return None

    async def heartbeat_once(self) -> HeartbeatReply | None:
        await self._probe()
        await self._observe()
        self.gpus_seen = await self._gpus()
        for gpu in self.gpus_seen:  # NVML said it failed (an Xid, ECC errors, the device lost)
            if gpu.failed and gpu.index not in self.manager.failed_gpus() and self.manager.has_gpu(gpu.index):
                self.fail_gpu(gpu.index, gpu.failed)
        held = self.instance_reports()
        if len(held) > MAX_INSTANCES:
            # The control plane gives a node MAX_PLACED_PER_NODE at most; should more be here (stops
            # under way, refusals), the beat reports what runs first rather than be refused whole.
            log.warning(
                "%d instances here, a heartbeat reports %d; the last ones are left out", len(held), MAX_INSTANCES
            )
            held = held[:MAX_INSTANCES]
        digested = self._digested(held)
        beat = self._beat(self.gpus_seen, digested)
        url = self.settings.control_url.rstrip("/") + "/v1/nodes/heartbeat"
        try:
            timeout = aiohttp.ClientTimeout(total=self.settings.tunables.post_timeout_s)
            encoded = self._encoded(beat)
            reply = None
            while reply is None:
                # A file-like body: aiohttp warns of bytes over 1 MiB, which a beat with specs may reach.
                headers = {**self.node_credential.headers(), "Content-Type": "application/json"}
                async with self._session.post(url, data=io.BytesIO(encoded), timeout=timeout, headers=headers) as resp:
                    if resp.status == 401 and self.node_credential.forget():
                        # Expired while the node was cut off, or signed by a key the control plane no
                        # longer holds: the node's own credential, at once.
                        log.warning("the control plane refused this node's renewed token (%s); showing its own", url)
                        continue
                    if resp.status != 200:
                        raise ValueError(f"HTTP {resp.status}: {(await resp.text())[:200]}")
                    reply = HeartbeatReply.from_json(await resp.json())
        except (TimeoutError, aiohttp.ClientError, ValueError) as exc:
            if self.reachable is not False:  # log the change, not every retry
                log.warning("control plane %s unreachable (%s); keeping every instance running, retrying", url, exc)
            self.reachable = False
            return None
        if self.reachable is not True:
            log.info("control plane %s reachable", url)
        self.reachable = True
        self.node_credential.update(reply.node_token)
        # The control plane keeps what the last beat told it (every spec it did not ask for again) and
        # its models' builds (what an authoritative reply assigns): nothing older.
        asked = set(reply.send_specs)
        reported = {(r.instance_id, r.spec_digest) for r in digested}
        assigned = {(a.instance_id, a.spec_digest) for a in reply.assignments} if reply.authoritative else set()
        self._control_has = {pair for pair in reported | assigned if pair[0] not in asked}
        if reply.authoritative:
            self.apply(self._with_specs(reply.assignments))
        return reply

    def _encoded(self, beat: NodeHeartbeat) -> bytes:
        """The heartbeat as JSON. Should it pass MAX_HEARTBEAT_BYTES (hundreds of reports whose details
        are long and not ASCII, up to 12 bytes a character escaped), it goes with every report's free
        texts cut to SHORT_TEXT characters, which leaves room for the specs (1,024 such reports take under
        7 MiB); only if it is still over do the specs stay behind: a beat the control plane refuses would
        cut the node off."""

        def encoded(reports: list[InstanceReport]) -> bytes:
            return json.dumps(dataclasses.replace(beat, instances=reports).to_json(), separators=(",", ":")).encode()

        body = encoded(beat.instances)
        if len(body) <= MAX_HEARTBEAT_BYTES:
            return body
        log.warning("heartbeat of %d bytes is over %d: sent with short details", len(body), MAX_HEARTBEAT_BYTES)
        short = [
            dataclasses.replace(r, detail=cut(r.detail, SHORT_TEXT), unplaceable=cut(r.unplaceable, SHORT_TEXT))
            for r in beat.instances
        ]
        body = encoded(short)
        if len(body) <= MAX_HEARTBEAT_BYTES:
            return body
        log.warning("heartbeat still over %d bytes with short details: sent without specs", MAX_HEARTBEAT_BYTES)
        return encoded([dataclasses.replace(r, spec=None) for r in short])

    def _with_specs(self, assigned: list[Assignment]) -> list[Assignment]:
        """The assignments with the spec filled in where the control plane left it out because this node
        holds a spec with that digest, or an earlier assignment of the reply carries it (sie.wire). Should
        the node not hold it (the instance went between the heartbeat and the reply), a running instance
        keeps the spec it runs, and one that does not run waits for the next reply, which carries it."""
        held = [*self.supervisor.all_specs().values(), *self._held_specs().values()]  # stopping ones too
        by_digest = {self._digest(spec): spec for spec in held}
        running = self.supervisor.running_specs()
        out = []
        for a in assigned:
            if a.spec is not None:
                by_digest.setdefault(a.spec_digest or self._digest(a.spec), a.spec)
                out.append(a)
                continue
            spec = by_digest.get(a.spec_digest) or running.get(a.instance_id)
            if spec is None:
                log.debug(
                    "instance %s assigned without a spec this node holds; the next reply brings it", a.instance_id
                )
                continue
            out.append(dataclasses.replace(a, spec=spec))
        return out

    def _held_specs(self) -> dict[str, dict[str, Any]]:
        """Instance id -> the spec it runs (or waits, or was refused) with."""
        return {
            **self.supervisor.running_specs(),
            **{iid: r.assignment.spec for iid, r in self.refused.items() if r.assignment.spec is not None},
            **{iid: p.assignment.spec for iid, p in self.pending.items() if p.assignment.spec is not None},
        }

    def apply(self, assigned: list[Assignment]) -> None:
        """Run what the control plane assigned: every assignment with its spec (`_with_specs`)."""
        plan = assignments.plan(assigned, self._held_specs(), self.supervisor.stopping_ids())
        self.kept_asleep = {a.instance_id for a in assigned if not a.awake}
        for a in assigned:
            self.supervisor.update_token(a.instance_id, a.token)
            waiting = self.pending.get(a.instance_id)
            if waiting is not None and a.token and waiting.assignment.token != a.token:
                waiting.assignment = a
        for iid in plan.stop:
            if self.refused.pop(iid, None) is not None or self.pending.pop(iid, None) is not None:
                continue  # nothing runs for it yet
            self._stops[iid] = self.spawn_task(self._stop(iid), f"stop:{iid}")
        for assignment in plan.respec:
            self._respec(assignment)
        for assignment in plan.start:
            self._queue(assignment)
        self.admit_pending()

    def _respec(self, assignment: Assignment) -> None:
        """A new spec that changes only the fleet's shape: the instance keeps running and takes it."""
        iid = assignment.instance_id
        waiting = self.pending.get(iid)
        if waiting is not None:
            waiting.assignment = assignment
        refused = self.refused.get(iid)
        if refused is not None:
            self.refused[iid] = dataclasses.replace(refused, assignment=assignment)
        if waiting is not None or refused is not None:
            return  # nothing runs for it yet
        try:
            service = parse_model_service(assignment.spec, f"assignment {iid}")
        except SpecError as exc:
            log.warning("instance %s: the new spec does not parse (%s); it keeps the one it runs", iid, exc)
            return
        self.supervisor.respec(iid, assignment.full_spec, service)

    def _queue(self, assignment: Assignment) -> None:
        try:
            service = parse_model_service(assignment.spec, f"assignment {assignment.instance_id}")
            check_engine_settings(service)
        except SpecError as exc:
            self._refuse(assignment, str(exc))
            return
        self.pending[assignment.instance_id] = Pending(assignment, service, self._clock())

    def _refuse(self, assignment: Assignment, reason: str) -> None:
        log.error("refusing %s (%s): %s", assignment.instance_id, assignment.model_id, reason)
        self.refused[assignment.instance_id] = Refused(assignment, reason)
        self.events.add("refused", assignment.instance_id, reason=reason)

    # ---- admission --------------------------------------------------------------------------------

    def admit_pending(self) -> None:
        """Admit what fits, most important first; at most one eviction starts, and while one runs
        nothing else is placed (the memory it frees is for the instance that asked)."""
        if not self.pending:
            return
        if self.pressure.busy is not None:
            for p in self.pending.values():
                if p.retry_at <= self._clock():  # one whose start failed keeps saying why
                    p.reason = f"waiting: {self.pressure.busy}"
            return
        order = sorted(
            self.pending.values(),
            key=lambda p: (p.service.spec.model.priority_level.rank, p.since, p.assignment.instance_id),
        )
        for p in order:
            iid = p.assignment.instance_id
            if p.retry_at > self._clock():
                continue
            decision = self.manager.admit(iid, p.service, self._clock())
            if isinstance(decision, (OffGPU, Placed)):
                del self.pending[iid]
                self._start(p, decision)
            elif isinstance(decision, Refuse):
                del self.pending[iid]
                self._refuse(p.assignment, decision.reason)
            elif isinstance(decision, Wait):
                self._waiting(
                    p, InstanceState.FAILED if decision.short_of_memory else InstanceState.LOADING, decision.reason
                )
            elif isinstance(decision, Evict):
                if self.settings.tunables.eviction is EvictionMode.OFF:
                    self._waiting(
                        p,
                        InstanceState.FAILED,
                        (
                            f"not enough GPU memory on GPU {','.join(map(str, decision.decision.gpu_indices))}: "
                            f"{', '.join(decision.victims)} would have to make way, and pre-eviction is off (--eviction off)"
                        ),
                    )
                elif self.pressure.ready:
                    p.state, p.reason = InstanceState.LOADING, f"making room: evicting {', '.join(decision.victims)}"
                    label = p.service.spec.model.priority_level.value
                    self.pressure.evict(
                        decision.victims, for_instance=iid, for_label=label, on_done=lambda ok: self.admit_pending()
                    )
                    return
                else:
                    p.state, p.reason = (
                        InstanceState.LOADING,
                        f"waiting to evict {', '.join(decision.victims)}: a recent eviction or wake failed",
                    )

    def _waiting(self, p: Pending, state: InstanceState, reason: str) -> None:
        if reason != p.reason:
            log.info("%s waits (%s): %s", p.assignment.instance_id, state.value, reason)
        p.state, p.reason = state, reason

    def _start(self, p: Pending, decision: OffGPU | Placed) -> None:
        iid = p.assignment.instance_id
        try:
            self.supervisor.start(p.assignment)  # leaves nothing behind when it raises
        except (SpecError, ValueError, ImportError) as exc:
            self.manager.release(iid)
            self._refuse(p.assignment, str(exc))
            return
        except OSError as exc:
            # The machine's, not the spec's: it may pass (a disk freed), so it waits, reported failed.
            self.manager.release(iid)
            p.state, p.reason = InstanceState.FAILED, f"could not start ({exc}); retrying in {START_RETRY_S:g} s"
            p.retry_at = self._clock() + START_RETRY_S
            self.pending[iid] = p
            log.warning("%s: %s", iid, p.reason)
            self.events.add("start_failed", iid, error=str(exc))
            return
        if isinstance(decision, Placed):
            self.events.add(
                "placed",
                iid,
                gpus=list(decision.gpu_indices),
                mb=round(decision.per_gpu_mb, 1),
                waited_s=round(self._clock() - p.since, 3),
            )
        else:
            self.events.add("placed", iid, gpus=[], mb=0.0, waited_s=round(self._clock() - p.since, 3))

    async def _stop(self, instance_id: str) -> None:
        try:
            await self.supervisor.stop(instance_id)
        finally:
            self._stops.pop(instance_id, None)
            self._health.pop(instance_id, None)
            self.sidecar_states.pop(instance_id, None)
            self._bad_states.pop(instance_id, None)
            self._answered.pop(instance_id, None)
            self.fleet_asleep.discard(instance_id)
            self.woken_for_request.pop(instance_id, None)
            if instance_id not in self.supervisor.instances:
                if self.manager.holds(instance_id):
                    self.events.add("released", instance_id, freed_mb=round(self.manager.held_mb(instance_id), 1))
                self.manager.release(instance_id)
                self.pressure.forget(instance_id)

    # ---- observation ------------------------------------------------------------------------------

    async def _probe(self) -> None:
        live = [i for i in self.supervisor.instances.values() if not i.stopping]
        asked = [i for i in live if i.sidecar_running()]  # the request carries the node's token
        healths = asyncio.gather(*(self._worker_health(i) for i in live))
        states = asyncio.gather(*(self.control.state(i.control_address) for i in asked))
        health, state = await asyncio.gather(healths, states)
        self._health = {i.instance_id: h for i, h in zip(live, health)}
        self.sidecar_states = {i.instance_id: self._read_state(i.instance_id, s) for i, s in zip(asked, state)}

    def _read_state(self, instance_id: str, body: dict[str, Any] | None) -> dict[str, Any] | None:
        """The sidecar's record if it is a valid one of its own instance; a reply that is not counts as no
        answer, and its reason is logged once (again only when it changes)."""
        if body is None:
            return None
        record, why = sidecar_record(instance_id, body)
        if record is not None:
            if self._bad_states.pop(instance_id, None) is not None:
                log.info("the sidecar of %s answers /-/state with a valid record again", instance_id)
            return record
        if self._bad_states.get(instance_id) != why:
            log.warning(
                "the sidecar of %s answered /-/state with a record the node host cannot use: %s", instance_id, why
            )
            self._bad_states[instance_id] = why
        return None

    def _asleep(self, instance_id: str) -> bool:
        """Its memory is released (the ledger holds it sleeping): a crashed worker of it waits for the wake."""
        return self.manager.state_of(instance_id) is EntryState.SLEEPING

    async def _worker_health(self, inst: Instance) -> str | None:
        return None if inst.worker_child is None else await self.control.health(inst.worker_address, inst.health_path)

    def _loading(self) -> list[Instance]:
        """Instances whose first load is under way (a wake is Pressure's to finish)."""
        return [
            i
            for iid, i in self.supervisor.instances.items()
            if not i.stopping
            and i.worker_child is not None
            and self.pressure.waking != iid
            and self.manager.state_of(iid) is EntryState.LOADING
        ]

    async def _check_loads(self) -> None:
        """A finished load frees its GPU for the next one, so loading workers are looked at every tick,
        not only at the heartbeat."""
        loading = self._loading()
        if not loading:
            return
        health = await asyncio.gather(*(self.control.health(i.worker_address, i.health_path) for i in loading))
        for inst, status in zip(loading, health):
            self._health[inst.instance_id] = status
        await self._mark_loaded([i for i, status in zip(loading, health) if status == "ok"])

    async def _mark_loaded(self, done: list[Instance]) -> None:
        if not done:
            return
        measured = await self._measure([i.worker_child.pid for i in done if i.worker_child]) if self._measure else {}
        for inst in done:
            iid = inst.instance_id
            if self.manager.state_of(iid) is not EntryState.LOADING or inst.worker_child is None:
                continue  # changed while measuring
            self.manager.loaded(iid, measured.get(inst.worker_child.pid))
            self.events.add(
                "loaded", iid, held_mb=round(self.manager.held_mb(iid), 1), measured=inst.worker_child.pid in measured
            )

    async def _observe(self) -> None:
        """Fold the probes into the ledger: loads that finished, demand, last use, measured memory."""
        await self._mark_loaded([i for i in self._loading() if self._health.get(i.instance_id) == "ok"])
        now = self._clock()
        measured: Mapping[int, Mapping[int, float]] = {}
        if self._measure is not None:
            pids = [i.worker_child.pid for i in self.supervisor.instances.values() if i.worker_child is not None]
            measured = await self._measure(pids) if pids else {}
        for iid, inst in self.supervisor.instances.items():
            if not self.manager.holds(iid) or inst.stopping:
                continue
            mine = measured.get(inst.worker_child.pid) if inst.worker_child is not None else None
            state = self.sidecar_states.get(iid)
            if state is None:
                continue
            demand = state["in_flight"] + state["queued"]  # bounded ints (sidecar_record)
            answered = state["requests_total"]
            used = now if demand or answered > self._answered.get(iid, answered) else None
            self._answered[iid] = answered
            self.manager.observe(
                iid,
                demand=demand,
                last_used=used,
                measured_mb=mine if self.manager.state_of(iid) is EntryState.LOADED else None,
            )

    def _starved(self, model_id: str) -> bool:
        """Demand is back for `model_id`: every awake instance of it here has requests queued."""
        awake = [
            self.sidecar_states.get(iid)
            for iid, inst in self.supervisor.instances.items()
            if inst.service.model_id == model_id and self.manager.state_of(iid) is EntryState.LOADED
        ]
        return bool(awake) and all(s is not None and s["queued"] > 0 for s in awake)

    def instance_reports(self) -> list[InstanceReport]:
        out = []
        for iid, inst in sorted(self.supervisor.instances.items()):
            report = reports.report(inst, self._health.get(iid))
            note = self.pressure.notes.get(iid)
            sidecar_state = (self.sidecar_states.get(iid) or {}).get("state")
            if note is not None and not inst.stopping:
                detail = "; ".join(d for d in (note.detail, report.detail) if d)
                report = dataclasses.replace(report, state=note.state or report.state, detail=detail)
            elif sidecar_state in ("draining", "sleeping") and not inst.stopping:
                report = dataclasses.replace(report, state=InstanceState(sidecar_state))
            out.append(dataclasses.replace(report, reserved_mb=self.manager.reserved_mb(iid)))
        for iid, p in sorted(self.pending.items()):
            out.append(
                InstanceReport(
                    instance_id=iid,
                    model_id=p.assignment.model_id,
                    version=p.service.spec.model.version,
                    state=p.state,
                    spec=p.assignment.spec,
                    detail=f"pending: {p.reason}",
                    # Short of memory with nothing it may evict: another node may have the room.
                    unplaceable=p.reason if p.state is InstanceState.FAILED else "",
                )
            )
        for _, refused in sorted(self.refused.items()):
            report = reports.refused_report(refused.assignment, refused.reason)
            out.append(dataclasses.replace(report, unplaceable=refused.reason))
        return [report.fitted() for report in out]

    def _digested(self, held: list[InstanceReport]) -> list[InstanceReport]:
        """The reports named by spec digest, each with its spec only where the control plane may not
        have it (sie.wire), each distinct spec once: at most MAX_SPEC_BYTES_PER_BEAT of specs, the rest
        in the next heartbeats."""
        budget = MAX_SPEC_BYTES_PER_BEAT
        in_beat: set[str] = set()
        digested = []
        for report in held:
            if report.spec is None:
                digested.append(report)
                continue
            digest = self._digest(report.spec)
            send = (report.instance_id, digest) not in self._control_has and digest not in in_beat
            if send:
                size = self._digest.size(report.spec)
                send = spec_fits(size, budget)
                if send:
                    budget -= size
                    in_beat.add(digest)
            digested.append(dataclasses.replace(report, spec=report.spec if send else None, spec_digest=digest))
        self._digest.retain(r.spec for r in held if r.spec is not None)  # forget the specs no longer held
        return digested
