"""Memory pressure, carried out: evictions and wakes, through the victims' sidecars (DESIGN.md section 6).

The decisions are pure and live elsewhere (placement.py picks victims, ledger.py says who may wake);
this is the shell that acts on them, one memory operation at a time per node:

  evict (mode "drain", the default), for each victim, all victims together:
      POST <victim sidecar>/-/sleep?reason=eviction&timeout_s=DRAIN
        the sidecar reports `draining` at once (xds_server marks the endpoint DRAINING, Envoy stops
        sending it new requests; any that still arrive get a retryable 503 that Envoy retries on another
        instance), lets in-flight work finish, has the worker release its memory, reports `sleeping`
        (it leaves EDS) and counts inference_evictions_total; its 200 comes back
      only then does the ledger free the victim's memory and the waiting instance get placed.
      A sleep that fails (409: still busy at the bound; no answer) is undone with /-/wake, nothing is
      freed, and no new eviction starts for `retry_after_s`.
  wake, when a sleeper fits again under the LOW watermark (wake_candidates; e.g. the P0 model that
      took its memory was deleted), or when demand for its model returns (every awake instance of the
      model on this node has requests queued) and it fits under the HIGH watermark without evicting
      anyone: reserve it in the ledger again (LOADING, so one load at a time per GPU holds), POST
      /-/wake, and mark it loaded once the sidecar answers ready.
  sleep for the fleet (sleep_for_fleet): the control plane keeps an instance asleep (its model's warm
      pool, or the one a model at zero keeps): drain and release as an eviction does, for no one.
  wake now (wake_now): a sleeping instance's sidecar holds a request and asks its node host (POST
      /v1/instances/<id>/wake); the wake runs at once, waits only for a memory operation under way,
      and its caller learns whether it serves or why not.

Two baselines for bench/eviction, never for production:
  "kill": the victim's worker is SIGKILLed at once, as an OOM kill would (no drain; its in-flight
          requests fail), and restarted from scratch to wake (unloaded, not asleep);
  "off":  no pre-eviction: an instance that would need a victim waits, reported failed with the reason.

Every step is an event (EventLog, GET /v1/events on the node host API) with its wall-clock time, and
the instances involved carry a Note (state and detail) that the instance report shows.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter, deque
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Any

from node_host.gpu_manager import GPUManager
from node_host.ledger import EntryState
from node_host.settings import EvictionMode, NodeTunables
from node_host.sidecar_control import Outcome, SidecarControl
from node_host.supervisor import Instance, ProcessManager
from sie.telemetry import InstanceState

log = logging.getLogger(__name__)

_POLL_S = 0.1
_LOAD_POLL_S = 0.02  # a restarted worker's health, while a request may wait for it
_WAKE_POLL_S = 0.005  # a request waits on this one: look often (it only reads the ledger)


@dataclass(frozen=True)
class Note:
    """What pressure handling says about an instance: `state` overrides the process view when set."""

    state: InstanceState | None
    detail: str


class EventLog:
    """The node's recent memory events, newest last: {"at": wall seconds, "kind", "instance_id", ...}.

    The log keeps the last `maxlen` events; `counts` counts every event of each kind since the node host
    started, for the Prometheus counters (node_host/metrics.py), which must never go down as old
    events fall off the log."""

    def __init__(self, wall: Callable[[], float] = time.time, maxlen: int = 1000):
        self._wall = wall
        self._events: deque[dict[str, Any]] = deque(maxlen=maxlen)
        self.counts: Counter[str] = Counter()

    def add(self, kind: str, instance_id: str, **fields: Any) -> dict[str, Any]:
        event = {"at": round(self._wall(), 4), "kind": kind, "instance_id": instance_id, **fields}
        self._events.append(event)
        self.counts[kind] += 1
        log.info("event %s %s %s", kind, instance_id, fields or "")
        return event

    def to_json(self, since: float | None = None) -> list[dict[str, Any]]:
        return [e for e in self._events if since is None or e["at"] >= since]


def clock_text(wall: float) -> str:
    return time.strftime("%H:%M:%S", time.localtime(wall)) + f".{int((wall % 1) * 1000):03d}"


class Pressure:
    def __init__(
        self,
        manager: GPUManager,
        supervisor: ProcessManager,
        control: SidecarControl,
        events: EventLog,
        *,
        spawn: Callable[[Coroutine[Any, Any, Any], str], asyncio.Task],
        mode: EvictionMode = NodeTunables.eviction,
        drain_timeout_s: float = NodeTunables.drain_timeout_s,
        wake_timeout_s: float = NodeTunables.wake_timeout_s,
        retry_after_s: float = NodeTunables.eviction_retry_s,
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
        sleep: Callable[[float], Coroutine[Any, Any, None]] = asyncio.sleep,
    ):
        self.manager = manager
        self.supervisor = supervisor
        self.control = control
        self.events = events
        self.mode = mode
        self._spawn = spawn
        self._drain_timeout = drain_timeout_s
        self._wake_timeout = wake_timeout_s
        self._retry_after = retry_after_s
        self._clock = clock
        self._wall = wall
        self._sleep = sleep
        self.busy: str | None = None  # the memory operation under way, in words
        self.waking: str | None = None  # the instance a wake is under way for (its load is ours to mark)
        self.notes: dict[str, Note] = {}
        self._quiet_until = float("-inf")

    # ---- what the agent calls -------------------------------------------------------------------

    @property
    def ready(self) -> bool:
        """No memory operation runs and none failed in the last `retry_after_s`."""
        return self.busy is None and self._clock() >= self._quiet_until

    def evict(
        self, victims: tuple[str, ...], *, for_instance: str, for_label: str, on_done: Callable[[bool], None]
    ) -> None:
        """Put `victims` to sleep (or kill them, in "kill" mode) to make room for `for_instance`; then
        call on_done(all went to sleep) on the event loop. Call only when `ready`."""
        assert self.ready, f"a memory operation is under way: {self.busy}"
        self.busy = f"evicting {', '.join(victims)} for {for_instance}"
        self.events.add("pressure", for_instance, victims=list(victims), mode=self.mode.value, model=for_label)
        self._spawn(self._evict(victims, for_instance, for_label, on_done), f"evict-for:{for_instance}")

    def step(
        self,
        starved: Callable[[str], bool] = lambda model_id: False,
        kept_asleep: Callable[[str], bool] = lambda instance_id: False,
    ) -> None:
        """Start what the ledger asks for, if nothing runs: relief for a GPU above its high watermark
        (loaded instances grew), else a wake for a sleeper that fits under the low watermark, else one
        whose model is `starved` (model id -> its awake instances here all have work queued) and fits.
        Sleepers the control plane keeps asleep (`kept_asleep`: the warm pool) wake only when it says so,
        or for a held request (wake_now)."""
        if not self.ready:
            return
        relief = self.manager.relief()
        if relief is not None:
            self.evict(
                relief.instance_ids,
                for_instance=f"gpu-{relief.gpu_index}",
                for_label=f"GPU {relief.gpu_index} grew above its high watermark",
                on_done=lambda ok: None,
            )
            return
        for instance_id in self.manager.wake_candidates():
            if kept_asleep(instance_id):
                continue
            if self._try_wake(instance_id, "its GPU has room under the low watermark again"):
                return
        for instance_id, model_id in self.manager.sleepers():
            if not kept_asleep(instance_id) and starved(model_id) and self.manager.fits_awake(instance_id):
                if self._try_wake(
                    instance_id, f"demand for {model_id} returned (its awake instances have work queued)"
                ):
                    return

    def sleep_for_fleet(self, instance_id: str, why: str) -> bool:
        """Drain an awake instance the control plane keeps asleep (the warm pool, a model at zero) and
        release its memory, as an eviction does but for no one. Starts only when `ready`; True if it did."""
        inst = self.supervisor.instances.get(instance_id)
        state = self.manager.state_of(instance_id)
        on_ledger = self.manager.holds(instance_id)  # an instance off the GPU (CPU engine, sim) holds no memory
        if not self.ready or inst is None or inst.stopping or (on_ledger and state is not EntryState.LOADED):
            return False
        self.busy = f"putting {instance_id} to sleep ({why})"
        self._spawn(self._fleet_sleep(inst, why), f"sleep:{instance_id}")
        return True

    def wake(self, instance_id: str, why: str) -> bool:
        """Wake a sleeper now if it fits under the high watermark; True if the wake started."""
        inst = self.supervisor.instances.get(instance_id)
        if inst is not None and not inst.stopping and not self.manager.holds(instance_id):
            self._spawn(self._wake_off_ledger(inst, why, self._wake_timeout), f"wake:{instance_id}")
            return True
        return self.ready and self._try_wake(instance_id, why)

    async def wake_now(self, instance_id: str, why: str, timeout_s: float) -> str | None:
        """Wake a sleeper for a request held at its sidecar, and return once it serves: None, or why it
        does not. A memory operation under way (another wake, an eviction) is waited for, within
        `timeout_s`; a wake already under way for this instance is joined, not repeated."""
        deadline = self._clock() + timeout_s
        inst = self.supervisor.instances.get(instance_id)
        if inst is not None and not inst.stopping and not self.manager.holds(instance_id):
            return await self._wake_off_ledger(inst, why, timeout_s)
        while True:
            inst = self.supervisor.instances.get(instance_id)
            if inst is None or inst.stopping:
                return f"{instance_id} does not run on this node (any more)"
            state = self.manager.state_of(instance_id)
            if state is EntryState.LOADED and self.waking != instance_id:
                return None
            if state is EntryState.SLEEPING and not self.manager.fits_awake(instance_id):
                return "no room on its GPU under the high watermark (memory went to other instances since it slept)"
            if self.busy is None and state is EntryState.SLEEPING:
                break
            if self.busy is not None and self.waking is None:
                return f"the node is reclaiming memory ({self.busy}); try again shortly"
            if self._clock() >= deadline:
                return f"still {self.busy or (state.value if state else 'not placed')} after {timeout_s:g} s"
            await self._sleep(_WAKE_POLL_S)
        refusal = self.manager.begin_wake(instance_id)
        if refusal is not None:
            return f"no room to wake it: {refusal}"
        self.busy, self.waking = f"waking {instance_id}", instance_id
        try:
            await self._wake(inst, why)
        except Exception as exc:  # noqa: BLE001 - the held request learns why; the log has the rest
            log.exception("wake of %s for a held request failed", instance_id)
            return f"the wake failed: {exc}"
        if self.manager.state_of(instance_id) is EntryState.LOADED:
            return None
        note = self.notes.get(instance_id)
        return note.detail if note is not None else "the wake failed"

    async def _wake_off_ledger(self, inst: Instance, why: str, timeout_s: float) -> str | None:
        """An instance off the GPU ledger holds no GPU memory: nothing to admit, its sidecar wakes it."""
        iid = inst.instance_id
        started = self._clock()
        self.events.add("wake_started", iid, gpu=None, mode=self.mode.value, why=why, unloaded=inst.worker_parked)
        ok, failure = await self._resume(inst, timeout_s)
        if not ok:
            self.events.add("wake_failed", iid, error=failure)
            return failure
        self.notes.pop(iid, None)
        self.events.add("woken", iid, took_s=round(self._clock() - started, 3), gpu=None)
        return None

    async def _fleet_sleep(self, inst: Instance, why: str) -> None:
        iid = inst.instance_id
        started = self._clock()
        try:
            self.notes[iid] = Note(InstanceState.DRAINING, f"draining to sleep: {why}")
            outcome = await self._sleep_call(inst, reason="idle", timeout_s=self._drain_timeout)
            if not outcome.ok:
                self._quiet_until = self._clock() + self._retry_after
                undo = await self._wake_call(inst, timeout_s=self._wake_timeout)
                detail = f"sleep ({why}) failed at {clock_text(self._wall())}: {outcome}"
                self.notes[iid] = Note(None, detail if undo.ok else f"{detail}; and serving again failed: {undo}")
                self.events.add("sleep_failed", iid, error=str(outcome))
                return
            if self.manager.holds(iid) and self.manager.state_of(iid) is not EntryState.LOADED:
                return  # stopped meanwhile: its stop releases the memory
            gpu = self.manager.gpu_of(iid)
            on_ledger = self.manager.holds(iid)
            freed = self.manager.sleep(iid) if on_ledger else 0.0
            where = f"{freed:.0f} MiB released on GPU {gpu}" if on_ledger else "no GPU memory held (off the GPU)"
            mode, how = inst.sleep_way
            if mode == "unload":
                # The worker was idle and released: stopping it loses nothing; a wake starts it afresh.
                self.supervisor.park_worker(iid, f"to unload it ({how}; it was asleep and idle)")
                where += f"; unloaded ({how})"
            self.notes[iid] = Note(
                InstanceState.SLEEPING, f"asleep: {why}; {where}; wakes for a request or when scaled up"
            )
            self.events.add("slept", iid, freed_mb=round(freed, 1), took_s=round(self._clock() - started, 3), why=why)
        finally:
            self.busy = None

    def _try_wake(self, instance_id: str, why: str) -> bool:
        inst = self.supervisor.instances.get(instance_id)
        if inst is None or inst.stopping:
            return False
        refusal = self.manager.begin_wake(instance_id)
        if refusal is not None:
            log.info("not waking %s: %s", instance_id, refusal)
            return False
        self.busy, self.waking = f"waking {instance_id}", instance_id
        self._spawn(self._wake(inst, why), f"wake:{instance_id}")
        return True

    def forget(self, instance_id: str) -> None:
        self.notes.pop(instance_id, None)

    # ---- eviction ---------------------------------------------------------------------------------

    async def _evict(
        self, victims: tuple[str, ...], for_instance: str, label: str, on_done: Callable[[bool], None]
    ) -> None:
        ok = False
        try:
            results = await asyncio.gather(*(self._put_to_sleep(v, for_instance, label) for v in victims))
            ok = all(results)
            if not ok:
                self._quiet_until = self._clock() + self._retry_after
        finally:
            self.busy = None
        on_done(ok)

    async def _put_to_sleep(self, victim: str, for_instance: str, label: str) -> bool:
        inst = self.supervisor.instances.get(victim)
        if inst is None or inst.stopping or self.manager.state_of(victim) is not EntryState.LOADED:
            self.events.add("eviction_skipped", victim, reason="no longer running and loaded")
            return False
        started, at = self._clock(), self._wall()
        gpu = self.manager.gpu_of(victim)
        why = f"evicted for {for_instance} ({label}) at {clock_text(at)}"
        self.events.add("eviction_started", victim, for_instance=for_instance, gpu=gpu, mode=self.mode.value)
        if self.mode is EvictionMode.KILL:
            self.supervisor.park_worker(victim)
            freed = self.manager.sleep(victim)
            self.notes[victim] = Note(
                InstanceState.STOPPED, f"unloaded: worker killed, {why}; --eviction kill (no drain)"
            )
            self.events.add(
                "memory_released", victim, freed_mb=round(freed, 1), took_s=round(self._clock() - started, 3), gpu=gpu
            )
            return True
        self.notes[victim] = Note(InstanceState.DRAINING, f"draining: {why}")
        outcome = await self._sleep_call(inst, reason="eviction", timeout_s=self._drain_timeout)
        if not outcome.ok:
            self.events.add("eviction_failed", victim, error=str(outcome))
            log.warning("eviction of %s for %s failed (%s); asking it to serve again", victim, for_instance, outcome)
            undo = await self._wake_call(inst, timeout_s=self._wake_timeout)
            detail = f"eviction for {for_instance} failed at {clock_text(self._wall())}: {outcome}"
            if not undo.ok:
                detail += f"; and serving again failed: {undo}"
            self.notes[victim] = Note(None, detail)
            return False
        if self.manager.state_of(victim) is not EntryState.LOADED:
            return False  # stopped meanwhile: its stop releases the memory
        freed = self.manager.sleep(victim)
        drain = outcome.body.get("drain") or {}
        mode, how = inst.sleep_way
        unloaded = ""
        if mode == "unload":
            # Drained and idle: stopping the worker loses nothing, and frees what its engine cannot release.
            self.supervisor.park_worker(victim, f"to unload it ({how}; evicted, drained and idle)")
            unloaded = f"; unloaded ({how})"
        self.notes[victim] = Note(
            InstanceState.SLEEPING,
            f"sleeping: {why}; drained {drain.get('finished', '?')} in flight in {drain.get('waited_s', '?')} s, "
            f"{freed:.0f} MiB released on GPU {gpu}{unloaded}; wakes when GPU {gpu} has room under its low watermark",
        )
        self.events.add(
            "memory_released",
            victim,
            freed_mb=round(freed, 1),
            took_s=round(self._clock() - started, 3),
            gpu=gpu,
            drained=drain.get("finished"),
            handed_back=drain.get("handed_back"),
        )
        return True

    # ---- wake -------------------------------------------------------------------------------------

    async def _wake(self, inst: Instance, why: str) -> None:
        iid = inst.instance_id
        started = self._clock()
        gpu = self.manager.gpu_of(iid)
        self.notes[iid] = Note(InstanceState.LOADING, f"waking on GPU {gpu}: {why}")
        self.events.add("wake_started", iid, gpu=gpu, mode=self.mode.value, why=why)
        try:
            ok, why = await self._resume(inst, self._wake_timeout)
        except Exception:
            self.manager.abort_wake(iid)
            raise
        finally:
            self.busy, self.waking = None, None
        if ok and self.manager.state_of(iid) is EntryState.LOADING:
            self.manager.loaded(iid)
            self.notes.pop(iid, None)
            self.events.add("woken", iid, took_s=round(self._clock() - started, 3), gpu=gpu)
            return
        self.manager.abort_wake(iid)
        self._quiet_until = self._clock() + self._retry_after
        self.notes[iid] = Note(
            None, f"wake failed at {clock_text(self._wall())}: {why}; retrying in {self._retry_after:g} s"
        )
        self.events.add("wake_failed", iid, error=why)

    async def _resume(self, inst: Instance, timeout_s: float) -> tuple[bool, str]:
        """Make the instance serve again: a worker that was stopped (parked: killed by the kill-mode
        eviction, or unloaded) is started afresh and waited for; then its sidecar's /-/wake resumes the
        memory (a fresh worker answers "already resident") and reports ready."""
        if inst.worker_parked:
            self.supervisor.unpark_worker(inst.instance_id)
            healthy, why = await self._until_healthy(inst, timeout_s)
            if not healthy:
                return False, why
        outcome = await self._wake_call(inst, timeout_s=timeout_s)
        return outcome.ok, str(outcome)

    async def _sleep_call(self, inst: Instance, *, reason: str, timeout_s: float) -> Outcome:
        """/-/sleep on the instance's sidecar, only while its process runs: the call carries the node's
        token, and while the sidecar is down another process of this host may listen on its port."""
        if not inst.sidecar_running():
            return Outcome(False, 0, error="its sidecar is not running")
        return await self.control.sleep(inst.control_address, reason=reason, timeout_s=timeout_s)

    async def _wake_call(self, inst: Instance, *, timeout_s: float) -> Outcome:
        """/-/wake on the instance's sidecar, only while its process runs (as _sleep_call)."""
        if not inst.sidecar_running():
            return Outcome(False, 0, error="its sidecar is not running")
        return await self.control.wake(inst.control_address, timeout_s=timeout_s)

    async def _until_healthy(self, inst: Instance, timeout_s: float | None = None) -> tuple[bool, str]:
        bound = self._wake_timeout if timeout_s is None else timeout_s
        deadline = self._clock() + bound
        while self._clock() < deadline:
            if await self.control.health(inst.worker_address, inst.health_path) == "ok":
                return True, "ready"
            await self._sleep(_LOAD_POLL_S)
        return False, f"the restarted worker was not healthy within {bound:g} s"
