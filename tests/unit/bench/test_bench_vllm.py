"""The pure parts of bench's vLLM runs: the CPU cap's duty cycle, the workloads' requests, the hit rate
from vLLM's counters, the KV sizing, the judged targets and the stack's engine check."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import yaml

from bench import prefix_vllm, routing_vllm
from bench.cpu_cap import duty, stop_for
from bench.loadgen import _error_type
from bench.prefix_workload import Workload, _chunk_choice_and_usage
from bench.routing_stack import RoutingStack, StackError
from bench.vllm_fleet import kv_cache_mb_for
from sie.spec import ModelService

WORDS = ("alpha", "bravo", "charlie", "delta", "echo", "foxtrot", "golf", "hotel")


@pytest.mark.parametrize(
    "fraction, period_ms, expected",
    [(1 / 3, 30.0, (0.010, 0.020)), (0.5, 20.0, (0.010, 0.010)), (1.0, 30.0, (0.030, 0.0))],
)
def test_the_cap_runs_its_fraction_of_every_period(fraction, period_ms, expected):
    assert duty(fraction, period_ms) == pytest.approx(expected)


@pytest.mark.parametrize("fraction, period_ms", [(0.0, 30.0), (1.5, 30.0), (-0.1, 30.0), (0.5, 0.0)])
def test_the_cap_refuses_what_it_cannot_do(fraction, period_ms):
    with pytest.raises(ValueError):
        duty(fraction, period_ms)


@pytest.mark.parametrize(
    "ran, held, fraction, expected",
    [
        (0.010, 0.0, 1 / 3, 0.020),  # on time: the planned stop
        (0.015, 0.0, 1 / 3, 0.030),  # woken late to stop it: it ran longer, so it stays stopped longer
        (0.030, 0.070, 1 / 3, 0.0),  # held too long before (woken late to resume): no stop until it caught up
        (1.0, 1.9, 1 / 3, 0.1),
    ],
)
def test_each_stop_keeps_the_share_since_the_cap_began(ran, held, fraction, expected):
    assert stop_for(ran, held, fraction) == pytest.approx(expected)


def test_the_kv_cache_holds_the_blocks_asked_for():
    # 128 tokens x 2 layers x K and V x 2 KV heads x 256 x 2 bytes = 0.5 MiB a block at hidden 1024
    assert kv_cache_mb_for(112) == 56
    assert kv_cache_mb_for(128) == 64
    assert kv_cache_mb_for(1, hidden_size=256) == 1  # rounded up, never below what was asked


def test_a_sim_request_is_as_it_was():
    body = Workload(shared=True).body("chat", 3)
    assert set(body) == {"model", "messages", "max_tokens", "stream"}
    assert body["messages"][0]["content"].split()[0].startswith("g")


def test_vllm_requests_draw_one_token_words_and_ask_for_exact_lengths_and_usage():
    shared, control = (
        Workload(shared=s, groups=4, prefix_words=50, query_words=6, engine="vllm", vocabulary=WORDS)
        for s in (True, False)
    )
    bodies = [shared.body("chat", i) for i in range(40)]
    assert all(b["ignore_eos"] is True and b["stream_options"] == {"include_usage": True} for b in bodies)
    systems = [b["messages"][0]["content"] for b in bodies]
    assert {len(s.split()) for s in systems} == {50} and set(" ".join(systems).split()) <= set(WORDS)
    assert len(set(systems)) == 4  # one system prompt per group, exactly repeated
    assert set(systems) == {shared.group_prefix(g) for g in range(4)}
    assert len({b["messages"][1]["content"] for b in bodies}) == 40  # every question its own
    assert shared.body("chat", 7) == shared.body("chat", 7)
    controls = [control.body("chat", i)["messages"][0]["content"] for i in range(40)]
    assert len(set(controls)) == 40 and {len(s.split()) for s in controls} == {50}


@pytest.mark.parametrize(
    "chunk, expected",
    [
        ({"choices": [{"delta": {"role": "assistant", "content": ""}}]}, (True, None)),
        ({"choices": [{"delta": {"content": ""}}]}, (True, None)),
        ({"choices": [], "usage": {"prompt_tokens": 1500, "completion_tokens": 16}}, (False, 16)),
        ({"usage": {"completion_tokens": "16"}}, (False, None)),
        ([1, 2], (False, None)),
    ],
)
def test_a_vllm_chunk_says_whether_it_carries_a_choice_and_its_usage(chunk, expected):
    assert _chunk_choice_and_usage(json.dumps(chunk).encode()) == expected


def test_garbage_chunks_carry_nothing():
    assert _chunk_choice_and_usage(b"not json") == (False, None)


def test_hit_rates_are_deltas_of_vllms_token_counters():
    before = {"chat-0": (100.0, 1000.0), "chat-1": (0.0, 0.0)}
    after = {"chat-0": (1000.0, 2000.0), "chat-1": (300.0, 1000.0), "chat-2": (5.0, 5.0)}
    out = prefix_vllm.hit_rates(before, after)
    assert out["per_instance"] == {"chat-0": 0.9, "chat-1": 0.3, "chat-2": 1.0}
    assert out["pooled"] == pytest.approx(round(1205 / 2005, 3))
    assert prefix_vllm.hit_rates(before, before) == {"per_instance": {"chat-0": None, "chat-1": None}, "pooled": None}


@pytest.mark.parametrize("doc", [prefix_vllm.cluster_doc(Path("/m")), routing_vllm.cluster_doc(Path("/m"))])
def test_the_vllm_specs_are_valid_and_size_the_cache(doc):
    service = ModelService.model_validate(doc)
    assert service.spec.backend.type.value == "vllm"
    extra = service.spec.backend.config.model_extra or {}
    assert extra["kv_cache_mb"] >= 16 and service.spec.backend.config.max_seq_len is not None


def test_the_prefix_workload_fits_vllms_cache_as_designed():
    # 11 whole blocks of system prompt per group; all 16 groups do not fit one instance, half of them and
    # the running requests' own blocks do
    per_group = prefix_vllm.PREFIX_BLOCKS
    assert prefix_vllm.GROUPS * per_group > prefix_vllm.KV_BLOCKS
    assert prefix_vllm.GROUPS // 2 * per_group + prefix_vllm.CONCURRENT <= prefix_vllm.KV_BLOCKS
    w = prefix_vllm.workloads(WORDS)["shared"]
    assert w.prefix_words > per_group * 128 and w.prefix_words + w.query_words + 32 < prefix_vllm.MAX_SEQ_LEN


def _prefix_results(lr_ttft, sp_ttft, lr_p99, sp_p99, failed=0):
    def rate(ttft, p99):
        return {"ttft_p90_ms": ttft, "e2e_p99_ms": p99, "failed": failed}

    def block(lr, sp):
        return {
            "capacity_rps": 10.0,
            "judged_rate": "8.00",
            "modes": {"least_request": {"rates": {"8.00": lr}}, "sie_prefix": {"rates": {"8.00": sp}}},
        }

    return {
        "shared": block(rate(lr_ttft, 100.0), rate(sp_ttft, 100.0)),
        "control": block(rate(50.0, lr_p99), rate(50.0, sp_p99)),
    }


@pytest.mark.parametrize(
    "results, holds",
    [
        (_prefix_results(400.0, 100.0, 1000.0, 1040.0), [True, True, True]),
        (_prefix_results(400.0, 250.0, 1000.0, 1060.0), [False, False, True]),
        (_prefix_results(400.0, None, 1000.0, 1000.0, failed=2), [False, True, False]),
    ],
)
def test_prefix_vllm_judges_its_three_targets(results, holds):
    verdicts = prefix_vllm.judged(results)
    assert [v["holds"] for v in verdicts] == holds
    assert verdicts[0]["limit"] == 0.5 and verdicts[1]["limit"] == 1.05 and verdicts[2]["limit"] == 0


def test_routing_vllm_requests_are_the_same_for_every_mode_and_their_length_in_words():
    a, b = routing_vllm.body(WORDS, 1, 5), routing_vllm.body(WORDS, 1, 5)
    tokens, new = routing_vllm.request(1, 5)
    assert a == b and len(a["prompt"].split()) == tokens and a["max_tokens"] == new and a["ignore_eos"] is True
    assert routing_vllm.body(WORDS, 2, 5) != a
    lo, hi = routing_vllm.PROMPT_TOKENS
    assert all(lo <= routing_vllm.request(1, i)[0] <= hi for i in range(200))


@pytest.mark.parametrize("ratio, holds", [(0.5, True), (0.8, True), (0.81, False), (None, False), (math.nan, False)])
def test_routing_vllm_judges_the_slowed_instance_target(ratio, holds):
    (verdict,) = routing_vllm.judged({"b: SIE/LR p99": ratio})
    assert verdict["holds"] is holds and verdict["limit"] == 0.8


def test_a_stack_refuses_an_engine_its_cluster_does_not_run(tmp_path):
    cluster = tmp_path / "cluster.yaml"
    cluster.write_text(yaml.safe_dump(prefix_vllm.cluster_doc(tmp_path / "model")))
    with pytest.raises(StackError, match="backend.type is 'vllm'"):
        RoutingStack(tmp_path / "s", cluster, policy="sie", lb_policy="least_request", engine="sim")
    with pytest.raises(StackError, match="engine must be"):
        RoutingStack(tmp_path / "s", cluster, policy="sie", lb_policy="least_request", engine="sglang")
    stack = RoutingStack(tmp_path / "s", cluster, policy="sie", lb_policy="least_request", engine="vllm", instances=2)
    assert stack.instance_ids == ["chat-0", "chat-1"] and stack.fleet is None


@pytest.mark.parametrize(
    "body, expected",
    [
        (b'{"error": {"type": "queue_timeout", "message": "waited"}}', "queue_timeout"),
        (b"no healthy upstream", "no healthy upstream"),
        (b"", "(empty)"),
        (b'{"error": "flat"}', '{"error": "flat"}'),
    ],
)
def test_a_failed_answer_is_counted_by_its_error_type(body, expected):
    assert _error_type(body) == expected
