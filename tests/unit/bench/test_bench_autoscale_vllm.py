"""bench.autoscale --engine vllm, its pure parts: the plan's specs and requests (and the sim's, unchanged), the
start window's accounting of failed requests, the limits derived from the plan, and the judged targets."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import yaml

from bench import autoscale, autoscale_vllm
from bench.autoscale import Plan, Request, Run
from bench.autoscale_vllm import QUICK, VllmPlan, error_kind, exposure, ideal_fraction, judged, start_window
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
        assert s.autoscale.scale_down_window_s == 40.0 and s.autoscale.warm_pool == 1
    assert plan.target == 7.0  # a whole number of closed-loop callers for the probe


def test_a_vllm_request_asks_for_exactly_its_tokens_and_shares_no_cached_block():
    a, b = QUICK.request_body(1), QUICK.request_body(2)
    assert a["ignore_eos"] is True and a["max_tokens"] == QUICK.max_tokens
    assert a["messages"][0]["content"] != b["messages"][0]["content"]
    assert a["messages"][0]["content"].startswith("request 1: ")  # they differ in the first block


def test_the_capacity_is_the_measured_one():
    assert VllmPlan().rate_1x == 0.0
    plan = replace(VllmPlan(), capacity_rps=12.5, saturation_measured_rps=14.0)
    assert (plan.rate_1x, plan.saturation_rps) == (12.5, 14.0)


@pytest.mark.parametrize(
    "plan, share, ideal",
    [
        (QUICK, 2 * 40 / (4 * 60), 4 / 6),  # 1x -> 2x -> 1x, 60 s phases, at most 2 instances
        (VllmPlan(), 2 * 40 / (4 * 180), 4 / 6),
        (replace(QUICK, phase_s=30.0), 2 * 30 / (4 * 30), 4 / 6),  # a phase shorter than a start: all of it
        (autoscale.QUICK, 4 * 30 / (6 * 30), 6 / 18),  # the sim's plan: the same rule gives about its 65%
    ],
)
def test_the_limits_follow_from_the_plan(plan: Plan, share, ideal):
    assert exposure(plan) == pytest.approx(share)
    assert ideal_fraction(plan) == pytest.approx(ideal)


def _req(at: float, phase: int, status: int = 200, latency_s: float = 0.5, error: str = "") -> Request:
    return Request(start=at, phase=phase, end=at + latency_s, status=status, error=error)


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


def test_only_refusals_in_the_start_window_are_not_lost():
    plan = replace(QUICK, capacity_rps=10.0)  # phases of 60 s from t0 = 1000
    t0 = 1000.0
    requests = [
        _req(t0 + 10, 0),
        _req(t0 + 61, 1, 429, error=_refusal("queue_full")),  # refused while the new instance starts: allowed
        _req(t0 + 95, 1, 503, error=_refusal("queue_timeout")),  # also in the first 40 s of the step
        _req(t0 + 99, 1, 503, latency_s=4.0),  # in the window but no refusal (an accepted request lost)
        _req(t0 + 101, 1, 503, error=_refusal("queue_timeout")),  # a refusal after the start's 40 s
        _req(t0 + 150, 2, 0, error="ServerDisconnectedError()"),  # a drain that dropped one
        _req(t0 + 70, 1, 200, latency_s=3.0),  # served, late
        _req(t0 + 71, 1, 200, latency_s=1.0),
    ]
    run = Run("sie", t0, requests, [], [], 10.0, 1)
    w = start_window(run, plan)
    assert w["step_phase"] == 2 and w["seconds"] == 40.0
    assert w["requests"] == 5 and w["within_sla"] == 1 and w["failed"] == 3
    assert w["failed_outside_window"] == 2
    assert w["lost"] == 3
    assert [x["kind"] for x in w["lost_first"]] == ["HTTP 503", "queue_timeout", "transport error"]
    assert w["failed_kinds"] == {"HTTP 503": 1, "queue_full": 1, "queue_timeout": 2, "transport error": 1}


def _results(sie_sla=0.9, top_sla=1.0, sie_is=200.0, top_is=360.0, against=0, lost=0) -> dict:
    return {
        "fixed-max": {"sla_attainment": top_sla, "instance_seconds": top_is},
        "sie": {
            "sla_attainment": sie_sla,
            "instance_seconds": sie_is,
            "changes_against_load": against,
            "start_window": {"lost": lost},
        },
    }


@pytest.mark.parametrize(
    "kwargs, holds",
    [
        ({}, [True, True, True, True]),
        # quick: 1 point + half of a third of the requests = 17.67 points below fixed-max's
        ({"sie_sla": 0.8234}, [True, True, True, True]),
        ({"sie_sla": 0.8232}, [False, True, True, True]),
        ({"top_sla": 0.9, "sie_sla": 0.7234}, [True, True, True, True]),
        # 0.8333 x 360 = 300 instance-seconds
        ({"sie_is": 300.0}, [True, True, True, True]),
        ({"sie_is": 300.1}, [True, False, True, True]),
        ({"against": 1}, [True, True, False, True]),
        ({"lost": 1}, [True, True, True, False]),
        ({"sie_sla": None, "lost": None}, [False, True, True, False]),
    ],
)
def test_the_judged_targets(kwargs, holds):
    checks = judged(_results(**kwargs), QUICK)
    assert [c["holds"] for c in checks] == holds
    assert checks[0]["limit"] == pytest.approx(kwargs.get("top_sla", 1.0) - 0.01 - 1 / 6, abs=1e-5)
    assert checks[1]["limit"] == 300.0


def test_without_fixed_max_only_the_sie_mode_targets_are_judged():
    results = _results()
    del results["fixed-max"]
    assert [c["limit"] for c in judged(results, QUICK)] == [0, 0]
    assert judged({"fixed-max": {}}, QUICK) == []


def test_the_probes_run_where_the_modes_allow():
    probes: dict = {}
    assert autoscale_vllm.prober("fixed-min", QUICK, probes) is not None  # the capacity probe, before its load
    assert autoscale_vllm.prober("fixed-min", replace(QUICK, capacity_rps=9.0), probes) is None  # known: none
    assert autoscale_vllm.prober("fixed-max", QUICK, probes) is not None  # the fleet's, reported
    assert autoscale_vllm.prober("sie", QUICK, probes) is None  # never in the autoscaled mode: it would scale


def test_the_report_leaves_out_the_sims_timing():
    got = autoscale_vllm.report_plan(QUICK)
    assert "decode_base_ms" not in got and "wake_ms" not in got
    assert got["phase_s"] == 60.0 and got["scale_down_window_s"] == 40.0 and got["max_replicas"] == 2


def test_the_sim_refuses_the_vllm_only_flag():
    with pytest.raises(SystemExit):
        autoscale.main(["--rate-1x", "5"])
