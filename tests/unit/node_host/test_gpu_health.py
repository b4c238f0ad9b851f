"""node_host.gpus.health and XidWatch over a fake NVML: temperature, uncorrected ECC errors, lost devices
and fatal Xid events, each failure sticky. The fake speaks pynvml's constants and error codes (taken from
the real module, so a wrong argument or code fails here), and checks every call gets the right ones."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pynvml
import pytest

from node_host.gpus import FATAL_XIDS, GpuHealth, GPUInventoryError, XidWatch, health

NOT_SUPPORTED, LOST, TIMEOUT = pynvml.NVML_ERROR_NOT_SUPPORTED, pynvml.NVML_ERROR_GPU_IS_LOST, pynvml.NVML_ERROR_TIMEOUT


class FakeNVMLError(Exception):
    def __init__(self, value: int):
        super().__init__(f"NVML error {value}")
        self.value = value


class Fails:
    """A device answer that is an NVML error with this code."""

    def __init__(self, code: int):
        self.code = code


class FakeNVML:
    """The pynvml functions health() and XidWatch call, over declared devices. A device is a dict:
    temp, ecc (a number or Fails(code)), handle, register, index (Fails(code) to make that call fail)."""

    NVMLError = FakeNVMLError
    NVML_ERROR_NOT_SUPPORTED = NOT_SUPPORTED
    NVML_ERROR_GPU_IS_LOST = LOST
    NVML_ERROR_TIMEOUT = TIMEOUT
    NVML_TEMPERATURE_GPU = pynvml.NVML_TEMPERATURE_GPU
    NVML_MEMORY_ERROR_TYPE_UNCORRECTED = pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED
    NVML_VOLATILE_ECC = pynvml.NVML_VOLATILE_ECC
    nvmlEventTypeXidCriticalError = pynvml.nvmlEventTypeXidCriticalError

    def __init__(self, *devices: dict[str, Any], event_set: Any = "set"):
        self.devices = list(devices)
        self.sessions = 0
        self.events: list[tuple[int, int] | Fails] = []  # (device index, xid), or an error nvmlEventSetWait raises
        self.event_set = event_set
        self.registered: list[int] = []
        self.freed = False

    def _answer(self, index: int, key: str, default: Any) -> Any:
        value = self.devices[index].get(key, default)
        if isinstance(value, Fails):
            raise FakeNVMLError(value.code)
        return value

    @staticmethod
    def _index(handle: int) -> int:
        return handle - 1000  # handles are ints, as pynvml's pointers are addresses

    def nvmlInit(self) -> None:
        self.sessions += 1

    def nvmlShutdown(self) -> None:
        self.sessions -= 1

    def nvmlDeviceGetCount(self) -> int:
        return len(self.devices)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> int:
        self._answer(index, "handle", None)
        return 1000 + index

    def nvmlDeviceGetIndex(self, handle: int) -> int:
        self._answer(self._index(handle), "index", None)
        return self._index(handle)

    def nvmlDeviceGetTemperature(self, handle: int, sensor: int) -> int:
        assert sensor == pynvml.NVML_TEMPERATURE_GPU
        return self._answer(self._index(handle), "temp", 40)

    def nvmlDeviceGetTotalEccErrors(self, handle: int, error_type: int, counter: int) -> int:
        assert (error_type, counter) == (pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, pynvml.NVML_VOLATILE_ECC)
        return self._answer(self._index(handle), "ecc", 0)

    def nvmlEventSetCreate(self) -> Any:
        if isinstance(self.event_set, Fails):
            raise FakeNVMLError(self.event_set.code)
        return self.event_set

    def nvmlDeviceRegisterEvents(self, handle: int, types: int, event_set: Any) -> None:
        assert types == pynvml.nvmlEventTypeXidCriticalError and event_set == self.event_set
        self._answer(self._index(handle), "register", None)
        self.registered.append(self._index(handle))

    def nvmlEventSetWait(self, event_set: Any, timeout_ms: int) -> SimpleNamespace:
        assert event_set == self.event_set and timeout_ms == 0  # never waits: it runs on every heartbeat
        if not self.events:
            raise FakeNVMLError(TIMEOUT)
        event = self.events.pop(0)
        if isinstance(event, Fails):
            raise FakeNVMLError(event.code)
        index, xid = event
        return SimpleNamespace(device=1000 + index, eventType=pynvml.nvmlEventTypeXidCriticalError, eventData=xid)

    def nvmlEventSetFree(self, event_set: Any) -> None:
        self.freed = True


@pytest.mark.parametrize(
    "device, expected",
    [
        ({"temp": 41}, GpuHealth(0, 41.0, "")),
        ({"temp": Fails(NOT_SUPPORTED)}, GpuHealth(0, None, "")),  # unknown, not zero
        ({"temp": 88, "ecc": 3}, GpuHealth(0, 88.0, "uncorrected ECC errors (3)")),
        ({"ecc": Fails(NOT_SUPPORTED)}, GpuHealth(0, 40.0, "")),  # no ECC on this GPU: unknown, not failed
        ({"ecc": Fails(pynvml.NVML_ERROR_NO_PERMISSION)}, GpuHealth(0, 40.0, "")),
        ({"temp": Fails(LOST)}, GpuHealth(0, None, "device lost")),
        ({"ecc": Fails(LOST)}, GpuHealth(0, None, "device lost")),
        ({"handle": Fails(LOST)}, GpuHealth(0, None, "device lost")),
    ],
    ids=[
        "healthy",
        "no-temperature",
        "ecc",
        "ecc-not-supported",
        "ecc-no-permission",
        "lost",
        "lost-ecc",
        "lost-handle",
    ],
)
def test_one_reading(device, expected):
    nvml = FakeNVML(device)
    assert health(nvml) == {0: expected}
    assert nvml.sessions == 0


@pytest.mark.parametrize(
    "xid, failed",
    [
        (79, "Xid 79: fallen off the bus"),
        (48, "Xid 48: double-bit ECC error"),
        (95, "Xid 95: uncontained ECC error"),
        (119, "Xid 119: GSP RPC timeout"),
        (13, ""),  # graphics engine exception: the application's fault, the GPU serves on
        (31, ""),  # a memory page fault: likewise
    ],
)
def test_xid_events(xid, failed):
    nvml = FakeNVML({}, {"temp": 50})
    watch = XidWatch(nvml)
    nvml.events = [(1, xid)]
    assert health(nvml, xids=watch) == {0: GpuHealth(0, 40.0, ""), 1: GpuHealth(1, 50.0, failed)}
    assert nvml.events == []  # read, so the next poll does not see it again
    watch.close()
    assert nvml.sessions == 0 and nvml.freed


def test_every_xid_named_fatal_fails_its_gpu():
    nvml = FakeNVML({})
    watch = XidWatch(nvml)
    for xid, why in FATAL_XIDS.items():
        nvml.events = [(0, 13), (0, xid), (0, 79 if xid != 79 else 48)]
        assert watch.poll() == {0: f"Xid {xid}: {why}"}  # the first fatal one names the failure
    assert {48, 62, 63, 64, 74, 79, 92, 94, 95, 119, 120} <= FATAL_XIDS.keys() and 13 not in FATAL_XIDS
    watch.close()


def test_an_xid_on_a_device_that_no_longer_answers_is_placed_by_its_handle_and_names_the_failure():
    nvml = FakeNVML({}, {"index": Fails(LOST), "temp": Fails(LOST)})
    watch = XidWatch(nvml)
    nvml.events = [(1, 79)]
    # NVML's reads alone say "device lost"; the Xid of the same reading says why.
    assert health(nvml, xids=watch)[1] == GpuHealth(1, None, "Xid 79: fallen off the bus")
    assert health(nvml, xids=watch)[1] == GpuHealth(1, None, "device lost")  # without it
    watch.close()
    watch.close()  # twice: the second ends no session of anyone else's
    assert nvml.sessions == 0 and watch.poll() == {}


def test_a_failure_is_sticky_and_keeps_its_first_reason():
    nvml = FakeNVML({"ecc": 2}, {})
    watch = XidWatch(nvml)
    first = health(nvml, xids=watch)
    assert first[0].failed == "uncorrected ECC errors (2)" and not first[1].failed
    nvml.devices[0]["ecc"] = 0  # a counter reset does not heal it
    nvml.events = [(0, 79), (1, 74)]
    second = health(nvml, xids=watch, before=first)
    assert second == {
        0: GpuHealth(0, 40.0, "uncorrected ECC errors (2)"),
        1: GpuHealth(1, 40.0, "Xid 74: NVLink error"),
    }
    third = health(nvml, xids=watch, before=second)  # no event any more: still failed
    assert third == second
    nvml.devices.pop()  # gone from NVML altogether: still reported, failed
    assert health(nvml, xids=watch, before=third)[1] == GpuHealth(1, None, "Xid 74: NVLink error")
    watch.close()


def test_the_watch_skips_gpus_without_events_and_reads_no_more_than_is_waiting():
    nvml = FakeNVML({}, {"register": Fails(NOT_SUPPORTED)}, {})
    watch = XidWatch(nvml)
    assert watch.watched == (0, 2) and nvml.registered == [0, 2]
    assert watch.poll() == {}  # nothing waiting: NVML's TIMEOUT ends the poll at once
    nvml.events = [(2, 13), Fails(pynvml.NVML_ERROR_UNKNOWN), (0, 79)]
    assert watch.poll() == {}  # an error ends this poll (logged); what is left waits for the next
    assert watch.poll() == {0: "Xid 79: fallen off the bus"}
    nvml.events = [(0, 13)] * 5000  # a storm is read in bounded polls
    assert watch.poll() == {} and 0 < len(nvml.events) < 5000
    watch.close()
    assert nvml.sessions == 0


def test_without_events_the_watch_does_not_start_and_health_goes_on_without_it():
    nvml = FakeNVML({"temp": 61}, event_set=Fails(NOT_SUPPORTED))
    with pytest.raises(GPUInventoryError, match="Xid"):
        XidWatch(nvml)
    assert nvml.sessions == 0  # the session it opened is closed again
    assert XidWatch.start(nvml) is None
    assert health(nvml, xids=None) == {0: GpuHealth(0, 61.0, "")}


def test_without_nvml_it_says_so():
    class NoDriver(FakeNVML):
        def nvmlInit(self) -> None:
            raise FakeNVMLError(pynvml.NVML_ERROR_LIBRARY_NOT_FOUND)

    with pytest.raises(GPUInventoryError, match="--virtual-gpus"):
        health(NoDriver({}))
    assert XidWatch.start(NoDriver({})) is None
