"""The unified metric schema every sidecar exports, whatever the backend (DESIGN.md section 3).

Labels are limited to model_id, service_type, priority_level (and version where a rollout needs it), so
one PromQL line can answer questions across all models, e.g. P0 models whose p99 is over 500 ms:

    histogram_quantile(0.99, sum by (model_id, le) (rate(inference_latency_seconds_bucket{priority_level="P0"}[1m]))) > 0.5
"""

LABELS = ("model_id", "service_type", "priority_level", "version")

LATENCY = "inference_latency_seconds"  # histogram, end to end at the sidecar
QUEUE_TIME = "inference_queue_time_seconds"  # histogram, time waiting for admission
REQUESTS = "inference_requests_total"  # counter, extra label `code`
IN_FLIGHT = "inference_in_flight"  # gauge
QUEUED = "inference_queued"  # gauge
INVALID_SCHEMA = "inference_invalid_schema_total"  # counter
EVICTIONS = "inference_evictions_total"  # counter
KV_CACHE_USAGE = "inference_kv_cache_usage_ratio"  # gauge, 0..1, absent where unknown
CACHE_HIT_RATE = "inference_cache_hit_ratio"  # gauge, 0..1: prompt tokens the engine's prefix cache held

LATENCY_BUCKETS_S = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
)

# SGLang's own worker metric names; every SIE worker backend exports these too.
SGLANG_RUNNING = "sglang:num_running_reqs"
SGLANG_QUEUE = "sglang:num_queue_reqs"
SGLANG_TOKEN_USAGE = "sglang:token_usage"
SGLANG_USED_TOKENS = "sglang:num_used_tokens"
SGLANG_MAX_TOTAL_TOKENS = "sglang:max_total_num_tokens"
SGLANG_CACHE_HIT_RATE = "sglang:cache_hit_rate"
SGLANG_GEN_THROUGHPUT = "sglang:gen_throughput"
SGLANG_E2E_LATENCY = "sglang:e2e_request_latency_seconds"
SGLANG_TTFT = "sglang:time_to_first_token_seconds"
SGLANG_QUEUE_TIME = "sglang:queue_time_seconds"

# SIE's own worker series beside SGLang's (a scorer's micro-batching, node_host/backends/runtime/batching.py).
WORKER_BATCH_SIZE = "sie_worker_batch_size"  # histogram: rows in one engine call
WORKER_BATCH_REQUESTS = "sie_worker_batch_requests"  # histogram: requests that shared one engine call
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 4096)
