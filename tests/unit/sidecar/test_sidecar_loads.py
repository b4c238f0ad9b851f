"""Parsing the worker's /v1/loads (several shapes) and its /metrics gauges."""

import pytest

from sie.worker_loads import EngineLoad, LoadsFormatError, parse_loads, parse_metrics_text


@pytest.mark.parametrize(
    "doc, expected",
    [
        # SIE's own backends: one flat object
        (
            {
                "num_running_reqs": 3,
                "num_waiting_reqs": 1,
                "token_usage": 0.4,
                "num_used_tokens": 400,
                "max_total_num_tokens": 1000,
            },
            EngineLoad(3, 1, 0.4, 400, 1000),
        ),
        # the sim backend with its prefix cache on, and a real SGLang's per-rank hit rates (mean)
        (
            {"num_running_reqs": 1, "num_waiting_reqs": 0, "token_usage": 0.1, "cache_hit_rate": 0.75},
            EngineLoad(1, 0, 0.1, None, None, 0.75),
        ),
        (
            {"loads": [{"num_running_reqs": 1, "cache_hit_rate": 0.5}, {"num_running_reqs": 1, "cache_hit_rate": 0.9}]},
            EngineLoad(2, None, None, None, None, pytest.approx(0.7)),
        ),
        # a scorer: no KV cache, token_usage null -> absent, not zero
        ({"num_running_reqs": 2, "num_waiting_reqs": 0, "token_usage": None}, EngineLoad(2, 0, None, None, None)),
        ({"num_running_reqs": 2, "num_waiting_reqs": 0}, EngineLoad(2, 0, None, None, None)),
        # SGLang with data parallelism: per-rank list; counts summed, KV token-weighted
        (
            {
                "loads": [
                    {
                        "dp_rank": 0,
                        "num_running_reqs": 2,
                        "num_waiting_reqs": 1,
                        "token_usage": 0.5,
                        "num_used_tokens": 500,
                        "max_total_num_tokens": 1000,
                    },
                    {
                        "dp_rank": 1,
                        "num_running_reqs": 1,
                        "num_waiting_reqs": 0,
                        "token_usage": 0.1,
                        "num_used_tokens": 300,
                        "max_total_num_tokens": 3000,
                    },
                ]
            },
            EngineLoad(3, 1, 0.2, 800, 4000),
        ),
        # per-rank list without token counts: plain mean of token_usage
        (
            {
                "loads": [
                    {"num_running_reqs": 1, "num_waiting_reqs": 0, "token_usage": 0.2},
                    {"num_running_reqs": 1, "num_waiting_reqs": 2, "token_usage": 0.6},
                ]
            },
            EngineLoad(2, 2, pytest.approx(0.4), None, None),
        ),
        # a bare list of ranks
        ([{"num_running_reqs": 4, "num_waiting_reqs": 4, "token_usage": 0.9}], EngineLoad(4, 4, 0.9, None, None)),
        # SGLang's shape: the ranks are summed; its aggregate (other names) is not mistaken for a rank
        (
            {
                "loads": [{"num_running_reqs": 1, "num_waiting_reqs": 0, "token_usage": 0.1}],
                "aggregate": {"total_running_reqs": 1, "total_waiting_reqs": 0, "avg_token_usage": 0.1},
            },
            EngineLoad(1, 0, 0.1, None, None),
        ),
        # an aggregate alone is read under SGLang's names
        (
            {"aggregate": {"total_running_reqs": 9, "total_waiting_reqs": 2, "avg_token_usage": 0.3}},
            EngineLoad(9, 2, 0.3, None, None),
        ),
        # SGLang's metric-style name for waiting; out-of-range usage is clamped
        ({"num_running_reqs": 0, "num_queue_reqs": 5, "token_usage": 1.3}, EngineLoad(0, 5, 1.0, None, None)),
        # bools and strings are not numbers
        (
            {"num_running_reqs": True, "num_waiting_reqs": "2", "token_usage": 0.1},
            EngineLoad(None, None, 0.1, None, None),
        ),
        # max tokens 0 (a scorer's) does not divide by zero
        ({"num_running_reqs": 1, "num_used_tokens": 0, "max_total_num_tokens": 0}, EngineLoad(1, None, None, 0, 0)),
    ],
)
def test_parse_loads(doc, expected):
    assert parse_loads(doc) == expected


@pytest.mark.parametrize("doc", [None, 3, "x", [], {}, {"loads": []}, {"unrelated": 1}, [1, 2]])
def test_unknown_shapes_are_refused(doc):
    with pytest.raises(LoadsFormatError):
        parse_loads(doc)


METRICS = """\
# HELP sglang:num_running_reqs The number of running requests.
# TYPE sglang:num_running_reqs gauge
sglang:num_running_reqs{model_name="qwen",dp_rank="0"} 3.0
sglang:num_running_reqs{model_name="qwen",dp_rank="1"} 2.0
# TYPE sglang:num_queue_reqs gauge
sglang:num_queue_reqs{model_name="qwen",dp_rank="0"} 1.0
# TYPE sglang:token_usage gauge
sglang:token_usage{model_name="qwen",dp_rank="0"} 0.5
sglang:token_usage{model_name="qwen",dp_rank="1"} 0.3
# TYPE sglang:e2e_request_latency_seconds histogram
sglang:e2e_request_latency_seconds_bucket{le="0.1",model_name="qwen"} 4.0
sglang:e2e_request_latency_seconds_count{model_name="qwen"} 4.0
"""


def test_parse_metrics_text():
    assert parse_metrics_text(METRICS) == EngineLoad(5, 1, pytest.approx(0.4), None, None)


def test_parse_metrics_prefers_token_counts():
    text = "sglang:num_used_tokens 250\nsglang:max_total_num_tokens 1000\nsglang:token_usage 0.9\n"
    assert parse_metrics_text(text).kv_usage == 0.25


def test_metrics_without_sglang_gauges_are_refused():
    with pytest.raises(LoadsFormatError):
        parse_metrics_text("# TYPE other gauge\nother 1\n")


def test_parse_metrics_reads_the_cache_hit_rate():
    text = 'sglang:num_running_reqs 1\nsglang:cache_hit_rate{model_name="m"} 0.625\n'
    assert parse_metrics_text(text).cache_hit_rate == 0.625
    assert parse_metrics_text("sglang:num_running_reqs 1\n").cache_hit_rate is None
