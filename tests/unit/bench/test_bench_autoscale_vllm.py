"""bench.autoscale --engine vllm, its pure parts: the plan's specs and requests (and the sim's, unchanged), the
start window's accounting of failed requests, the limits derived from the plan, and the judged targets."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import yaml

from bench import autoscale, autoscale_vllm
from bench.autoscale import Plan, Poll, Request, Run
from bench.autoscale_vllm import QUICK, VllmPlan, error_kind, exposure, failures, ideal_fraction, judged, scale_up
from sie.cluster import load_cluster


def test_the_sim_plan_builds_the_spec_it_always_did():
    spec = autoscale.model_service(autoscale.QUICK, "sie")["spec"]
    assert spec["model"] == {"name": "chat", "version": "1.0", "service_type": "llm", "priority_level": "P1"}
    assert spec["backend"] == {
        "type": "sim",
        "config": {"decode_base_ms": 16.0, "decode_ms_per_request": 0.25, "max_running_requests": 32, "wake_ms": 150.0},
    }
    assert spec["autoscale"] == {"scale_down_window_s": 10.0, "warm_pool": 5}
    assert autoscale.QUICK.request_body(7) == {
        "model": "chat",
        "messages": [{"role": "user", "content": "request 7: how many canaries fit in a mine"}],
        "max_tokens": 16,
    }
    assert autoscale.QUICK.cluster() == {"host": "127.0.0.1"}
    assert autoscale.QUICK.rate_1x == pytest.approx(15.98, abs=0.01)


@pytest.mark.parametrize(
    "mode, low, high, scaled",
    [("fixed-min", 1, 1, False), ("fixed-max", 2, 2, False), ("sie", 1, 2, True)],
)
def test_each_mode_is_a_vllm_model_a_cluster_file_accepts(tmp_path: Path, mode, low, high, scaled):
    model = tmp_path / "models" / "tiny"
    model.mkdir(parents=True)
    (model / "config.json").write_text("{}")
    plan = replace(QUICK, model_path=str(model))
    docs = [{"kind": "Cluster", "spec": plan.cluster()}, autoscale.model_service(plan, mode)]
    path = tmp_path / "cluster.yaml"
    path.write_text(yaml.safe_dump_all(docs, sort_keys=False))
    (svc,) = load_cluster(path).services
    s = svc.spec
    assert s.backend.type == "vllm" and s.model.path == str(model)
    assert (s.sla.min_replicas, s.sla.max_replicas) == (low, high)
    assert s.resources.max_concurrent_requests == 10
    if scaled:
        assert s.autoscale.scale_down_window_s == 60.0 and s.autoscale.warm_pool == 1
    assert plan.target == 7.0  # a whole number of closed-loop callers for the probe


def test_a_vllm_request_asks_for_exactly_its_tokens_and_shares_no_cached_block():
    a, b = QUICK.request_body(1), QUICK.request_body(2)
    assert a["ignore_eos"] is True and a["max_tokens"] == QUICK.max_tokens
    assert a["messages"][0]["content"] != b["messages"][0]["content"]
    assert a["messages"][0]["content"].startswith("request 1: ")  # they differ in the first block


def test_the_capacity_is_the_measured_one():
    assert VllmPlan().rate_1x == 0.0
    assert replace(VllmPlan(), capacity_rps=5.5).rate_1x == 5.5


@pytest.mark.parametrize(
    "plan, window_s, share, ideal",
    [
        (QUICK, 45.0, 2 * 45 / (4 * 90), 4 / 6),  # 1x -> 2x -> 1x, 90 s phases, at most 2 instances
        (VllmPlan(), 45.0, 2 * 45 / (4 * 180), 4 / 6),
        (QUICK, 200.0, 2 * 90 / (4 * 90), 4 / 6),  # a window past the phase: all of the phase
        (QUICK, -1.0, 0.0, 4 / 6),
        (autoscale.QUICK, 5.0, 4 * 5 / (6 * 30), 6 / 18),  # the sim's plan: the same rule gives about its 65%
    ],
)
def test_the_limits_follow_from_the_plan(plan: Plan, window_s, share, ideal):
    assert exposure(plan, window_s) == pytest.approx(share)
    assert ideal_fraction(plan) == pytest.approx(ideal)


T0 = 1000.0  # phases of 90 s (QUICK): the 2x phase from T0 + 90


def _poll(at: float, desired: int, **states: str) -> Poll:
    ready = sum(1 for s in states.values() if s == "ready")
    return Poll(T0 + at, ready, ready, desired, desired, "", dict(states))


@pytest.mark.parametrize(
    "polls, expected",
    [
        # decided 1.5 s after the step, the woken instance serving 50 s after that: window 5 + 50
        (
            [
                _poll(89.5, 1, a="ready", b="sleeping"),
                _poll(91.5, 2, a="ready", b="sleeping"),
                _poll(100.0, 2, a="ready", b="loading"),
                _poll(141.5, 2, a="ready", b="ready"),
            ],
            {"decided_s": 1.5, "new_ready_s": 51.5, "start_s": 50.0, "started_in_phase": True, "window_s": 55.0},
        ),
        # it never served within the phase: the window runs to the phase's end (88.5 s of start)
        (
            [_poll(89.5, 1, a="ready", b="sleeping"), _poll(91.5, 2, a="ready", b="loading")],
            {"decided_s": 1.5, "new_ready_s": None, "start_s": 88.5, "started_in_phase": False, "window_s": 93.5},
        ),
        # nothing decided: only the reaction's 5 s are allowed for
        (
            [_poll(89.5, 1, a="ready", b="sleeping"), _poll(120.0, 1, a="ready", b="sleeping")],
            {"decided_s": None, "new_ready_s": None, "start_s": None, "started_in_phase": False, "window_s": 5.0},
        ),
    ],
)
def test_the_scale_up_is_timed_from_the_decision_to_the_new_instance_serving(polls, expected):
    got = scale_up(Run("sie", T0, [], polls, [], 10.0, 1), QUICK)
    assert {k: got[k] for k in expected} == expected
    assert got["step_phase"] == 2
    assert got["exposure"] == pytest.approx(exposure(QUICK, expected["window_s"]), abs=1e-5)


def _req(at: float, phase: int, status: int = 200, latency_s: float = 0.5, error: str = "") -> Request:
    return Request(start=T0 + at, phase=phase, end=T0 + at + latency_s, status=status, error=error)


def _refusal(kind: str) -> str:
    return json.dumps({"error": {"type": kind, "message": "model chat: ..."}})


@pytest.mark.parametrize(
    "status, error, kind",
    [
        (200, "", "ok"),
        (429, _refusal("queue_full"), "queue_full"),
        (503, _refusal("queue_timeout"), "queue_timeout"),
        (503, '{"error": {"type": "upstream_unavail', "HTTP 503"),  # cut short before the type's end
        (502, "", "HTTP 502"),
        (0, "ClientOSError(104, 'Connection reset by peer')", "transport error"),
        (-1, "", "no answer"),
    ],
)
def test_a_failed_request_is_named_by_what_it_got(status, error, kind):
    assert error_kind(_req(0.0, 0, status, error=error)) == kind


def test_only_refusals_while_the_scale_up_comes_are_not_lost():
    requests = [
        _req(10, 0),
        _req(91, 1, 429, error=_refusal("queue_full")),  # refused while the new instance starts: allowed
        _req(140, 1, 503, error=_refusal("queue_timeout")),  # also within the 55 s window
        _req(99, 1, 503, latency_s=4.0),  # in the window but no refusal (an accepted request lost)
        _req(146, 1, 503, error=_refusal("queue_timeout")),  # a refusal after the window
        _req(200, 2, 0, error="ServerDisconnectedError()"),  # a drain that dropped one
        _req(95, 1, 200, latency_s=5.0),  # served, late: an SLA miss, not a failure
    ]
    run = Run("sie", T0, requests, [], [], 10.0, 1)
    got = failures(run, QUICK, 55.0)
    assert got["failed_in_window"] == 3 and got["lost"] == 3
    assert [x["kind"] for x in got["lost_first"]] == ["HTTP 503", "queue_timeout", "transport error"]
    assert got["failed_kinds"] == {"HTTP 503": 1, "queue_full": 1, "queue_timeout": 2, "transport error": 1}
    assert failures(run, QUICK, 0.0)["lost"] == 5  # a fixed mode waits for no start: every failure counts


def _results(sie_sla=0.95, top_sla=1.0, sie_is=300.0, top_is=540.0, against=0, lost=0, share=0.15) -> dict:
    return {
        "fixed-max": {"sla_attainment": top_sla, "instance_seconds": top_is},
        "sie": {
            "sla_attainment": sie_sla,
            "instance_seconds": sie_is,
            "changes_against_load": against,
            "scale_up": {"exposure": share, "window_s": 59.0},
            "failures": {"lost": lost},
        },
    }


@pytest.mark.parametrize(
    "kwargs, holds",
    [
        ({}, [True, True, True, True]),
        # 1 point + half of the exposure (0.15) = 8.5 points below fixed-max's
        ({"sie_sla": 0.915}, [True, True, True, True]),
        ({"sie_sla": 0.9149}, [False, True, True, True]),
        ({"top_sla": 0.95, "sie_sla": 0.865}, [True, True, True, True]),
        ({"share": 0.0, "sie_sla": 0.98}, [False, True, True, True]),  # no scale-up measured: 1 point only
        # 0.8333 x 540 = 450 instance-seconds
        ({"sie_is": 450.0}, [True, True, True, True]),
        ({"sie_is": 450.1}, [True, False, True, True]),
        ({"against": 1}, [True, True, False, True]),
        ({"lost": 1}, [True, True, True, False]),
        ({"sie_sla": None, "lost": None}, [False, True, True, False]),
    ],
)
def test_the_judged_targets(kwargs, holds):
    checks = judged(_results(**kwargs), QUICK)
    assert [c["holds"] for c in checks] == holds
    assert checks[0]["limit"] == pytest.approx(
        kwargs.get("top_sla", 1.0) - 0.01 - kwargs.get("share", 0.15) / 2, abs=1e-5
    )
    assert checks[1]["limit"] == 450.0


def test_without_fixed_max_only_the_sie_mode_targets_are_judged():
    results = _results()
    del results["fixed-max"]
    assert [c["limit"] for c in judged(results, QUICK)] == [0, 0]
    assert judged({"fixed-max": {}}, QUICK) == []


def test_the_probes_run_where_the_modes_allow():
    probes: dict = {}
    assert autoscale_vllm.prober("fixed-max", QUICK, probes) is not None  # the capacity probe, before its load
    assert autoscale_vllm.prober("fixed-max", replace(QUICK, capacity_rps=9.0), probes) is None  # known: none
    assert autoscale_vllm.prober("fixed-min", QUICK, probes) is not None  # one instance alone, reported
    assert autoscale_vllm.prober("sie", QUICK, probes) is None  # never in the autoscaled mode: it would scale


def test_the_report_leaves_out_the_sims_timing():
    got = autoscale_vllm.report_plan(QUICK)
    assert "decode_base_ms" not in got and "wake_ms" not in got
    assert got["phase_s"] == 90.0 and got["scale_down_window_s"] == 60.0 and got["max_replicas"] == 2


def test_the_sim_refuses_the_vllm_only_flag():
    with pytest.raises(SystemExit):
        autoscale.main(["--rate-1x", "5"])
