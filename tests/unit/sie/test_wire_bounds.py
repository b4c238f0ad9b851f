"""What a heartbeat may carry, held where the control plane reads it (sie.wire.NodeHeartbeat.from_json):
specs as a node host sends them (sie.wire.spec_fits: within MAX_SPEC_BYTES_PER_BEAT, the first whatever
its size), addresses as host:port."""

from __future__ import annotations

import json

import pytest

from sie.errors import SpecError
from sie.spec import MAX_SPEC_BYTES, spec_size
from sie.telemetry import InstanceState
from sie.wire import ADDRESS_FIELDS, MAX_SPEC_BYTES_PER_BEAT, InstanceReport, NodeHeartbeat


def _spec(size: int, salt: int = 0) -> dict:
    """A spec whose canonical JSON has exactly `size` bytes."""
    spec = {"salt": salt, "pad": ""}
    spec["pad"] = "x" * (size - spec_size(spec))
    assert spec_size(spec) == size
    return spec


def _beat(*reports: dict) -> dict:
    return {"node": "n1", "address": "http://127.0.0.1:1", "instances": list(reports)}


def _report(iid: str = "a-0", spec: dict | None = None, **addresses: str) -> dict:
    rep = InstanceReport(
        iid, "a", "1", InstanceState.READY, spec, **({"sidecar_address": "127.0.0.1:9000"} | addresses)
    )
    return json.loads(json.dumps({**rep.__dict__, "state": "ready"}))


def _problems(doc: dict) -> list[tuple[str, str]]:
    with pytest.raises(SpecError) as err:
        NodeHeartbeat.from_json(doc)
    return [(p.path, p.reason) for p in err.value.problems]


def test_one_spec_goes_whatever_its_size_as_a_node_host_sends_it():
    """A spec admitted before MAX_SPEC_BYTES existed may be larger: refusing it would cut its node off."""
    beat = NodeHeartbeat.from_json(_beat(_report(), _report("a-1", spec=_spec(MAX_SPEC_BYTES_PER_BEAT + 1))))
    assert spec_size(beat.instances[1].spec or {}) == MAX_SPEC_BYTES_PER_BEAT + 1
    [(path, reason)] = _problems(
        _beat(_report(spec=_spec(MAX_SPEC_BYTES_PER_BEAT + 1)), _report("a-1", spec=_spec(100, salt=1)))
    )
    assert path == "instances[1].spec" and str(MAX_SPEC_BYTES_PER_BEAT) in reason


def test_specs_over_the_beats_bound_are_refused_at_the_first_past_it():
    per = MAX_SPEC_BYTES
    fit = MAX_SPEC_BYTES_PER_BEAT // per  # this many fill the beat exactly
    reports = [_report(f"a-{i}", spec=_spec(per, salt=i)) for i in range(fit)]
    assert len(NodeHeartbeat.from_json(_beat(*reports)).instances) == fit
    [(path, reason)] = _problems(_beat(*reports, _report("a-x", spec=_spec(100, salt=-1))))
    assert path == f"instances[{fit}].spec" and str(MAX_SPEC_BYTES_PER_BEAT) in reason


@pytest.mark.parametrize(
    "address",
    [
        "127.0.0.1:9000",
        "[::1]:9000",
        "::1:9000",  # as the registry reads it: the last colon's
        "node-1.example.internal:65535",
        "10.0.0.7:1",
    ],
)
def test_host_port_addresses_are_read(address):
    reports = [_report(**{name: address}) for name in ADDRESS_FIELDS]
    assert NodeHeartbeat.from_json(_beat(*reports))


@pytest.mark.parametrize(
    "address, why",
    [
        ("127.0.0.1:\u00b2", "port"),  # str.isdigit() takes it
        ("127.0.0.1:\uff19\uff10", "port"),  # full-width 90: int() reads it as 90
        ("127.0.0.1:\u0663", "port"),
        ("127.0.0.1:0", "port"),
        ("127.0.0.1:65536", "port"),
        ("127.0.0.1:000009000", "port"),
        ("127.0.0.1:", "port"),
        ("127.0.0.1: 9000", "port"),
        ("127.0.0.1", "host:port"),
        (":9000", "host:port"),
        ("", "host:port"),
        ("[::1:9000", "host"),
        ("[not-v6]:9000", "host"),
        ("bad host:9000", "host"),
        ("h\u00e9te:9000", "host"),
        ("-lead:9000", "host"),
    ],
)
def test_an_address_that_is_not_host_port_is_refused_naming_its_field(address, why):
    for name in ADDRESS_FIELDS:
        problems = _problems(_beat(_report(), _report("a-1", **{name: address})))
        assert [path for path, _ in problems] == [f"instances[1].{name}"]
        assert why in problems[0][1]


def test_many_bad_addresses_are_listed_within_the_usual_bound():
    reports = [_report(f"a-{i}", sidecar_address="x", control_address="y") for i in range(50)]
    assert len(_problems(_beat(*reports))) == 20
