"""The ModelService spec: one model, how it is served, and what it promises.

One spec, three spellings: a YAML/JSON file (standalone), the admin API (`POST /v1/models`) and the
Kubernetes CRD `ModelService`. Field names are snake_case; the Kubernetes spellings the source article
uses (`nodeSelector`, `livenessProbe`, ...) are accepted as aliases so a user's existing file works.

Validation is strict (unknown keys are errors, so a typo is never silently ignored), and every error
names the field path and the reason; see `sie.errors.SpecError`.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from enum import Enum
from typing import Annotated, Any, Final, Literal

from packaging.requirements import InvalidRequirement, Requirement
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

API_GROUP = "sie.io"
API_VERSION: Final = "sie.io/v1alpha1"
KIND: Final = "ModelService"

# Model ids become Envoy cluster names, route names, Prometheus label values and Kubernetes object
# names, so they follow the strictest of those: a DNS-1123 label.
MODEL_ID_PATTERN = r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$"
_MODEL_ID_RE = re.compile(MODEL_ID_PATTERN)


class Priority(str, Enum):
    """P0 is the most important. Lower priorities are shed and evicted first; P0 never makes way."""

    P0 = "P0"
    P1 = "P1"
    P2 = "P2"

    @property
    def rank(self) -> int:
        """0 for P0: smaller is more important."""
        return int(self.value[1])


class ServiceType(str, Enum):
    LLM = "llm"
    SCORING = "scoring"
    NER = "ner"
    CLASSIFICATION = "classification"
    EMBEDDING = "embedding"


class BackendType(str, Enum):
    SGLANG = "sglang"
    TORCH = "torch"
    SKLEARN = "sklearn"
    SIM = "sim"
    VLLM = "vllm"
    TRITON = "triton"


class _Strict(BaseModel):
    # allow_inf_nan=False: no spec figure may be infinite or NaN (each becomes an Envoy duration, a
    # counter or a breaker threshold somewhere).
    model_config = ConfigDict(extra="forbid", populate_by_name=True, frozen=True, allow_inf_nan=False)


class ModelInfo(_Strict):
    name: str = Field(pattern=MODEL_ID_PATTERN, description="Model id: a DNS-1123 label, unique in the cluster.")
    # Versions become metric label values and Envoy names: a short token, no spaces or quotes.
    version: str = Field(default="0.0.0", min_length=1, max_length=64, pattern=r"^[A-Za-z0-9][A-Za-z0-9._+-]*$")
    image: str | None = Field(default=None, max_length=512, description="Container image (Kubernetes).")
    path: str | None = Field(
        default=None,
        max_length=4096,
        description="Local weights directory or scorer file, under one of the node's model roots.",
    )
    sha256: str | None = Field(
        default=None,
        pattern=r"^[0-9a-f]{64}$",
        description="The model file's SHA-256 (hex). Required to load a pickle/joblib file, which can run code.",
    )
    service_type: ServiceType = ServiceType.LLM
    priority_level: Priority = Priority.P1


class BackendConfig(BaseModel):
    """Engine settings. Known keys are checked; other engine arguments pass through to the engine."""

    model_config = ConfigDict(extra="allow", populate_by_name=True, frozen=True)

    tp_size: int = Field(default=1, ge=1, le=64)
    max_seq_len: int | None = Field(default=None, ge=1, le=10_000_000)

    @model_validator(mode="after")
    def _engine_args_bounded(self) -> BackendConfig:
        for key, value in (self.model_extra or {}).items():
            if not re.fullmatch(r"[A-Za-z][A-Za-z0-9_.-]{0,63}", key):
                raise ValueError(f"engine argument {key[:64]!r} is not a plain name (letters, digits, _ . -)")
            if isinstance(value, str) and len(value) > 4096:
                raise ValueError(f"engine argument {key}: the value is longer than 4096 characters")
        return self


class Backend(_Strict):
    type: BackendType
    config: BackendConfig = Field(default_factory=BackendConfig)
    requires: list[str] = Field(
        default_factory=list,
        description="Version constraints checked against the node, e.g. 'cuda>=12.1', 'sglang==0.5.*'.",
    )

    @field_validator("requires")
    @classmethod
    def _requirements_parse(cls, value: list[str]) -> list[str]:
        for item in value:
            try:
                Requirement(item)
            except InvalidRequirement as exc:
                raise ValueError(f"{item!r} is not a version constraint like 'cuda>=12.1' ({exc})") from None
        return value


_K8S_QUANTITY = re.compile(r"^[0-9]+(\.[0-9]+)?(Ki|Mi|Gi|Ti|Pi|Ei|k|M|G|T|P|E|m)?$")


class Resources(_Strict):
    min_gpu_memory_mb: int | None = Field(default=None, ge=0, le=16 * 1024 * 1024)
    max_concurrent_requests: int = Field(default=64, ge=1, le=100_000)
    gpus: int | None = Field(
        default=None, ge=0, le=64, description="GPUs per instance; defaults to limits[nvidia.com/gpu] or 0."
    )
    limits: dict[str, int | float | str] = Field(default_factory=dict)
    requests: dict[str, int | float | str] = Field(default_factory=dict)

    @field_validator("limits", "requests")
    @classmethod
    def _quantities(cls, value: dict[str, Any]) -> dict[str, Any]:
        for key, quantity in value.items():
            if isinstance(quantity, str) and not _K8S_QUANTITY.match(quantity):
                raise ValueError(f"{key}: {quantity!r} is not a Kubernetes quantity such as '32Gi' or '500m'")
            if isinstance(quantity, (int, float)) and quantity < 0:
                raise ValueError(f"{key}: must not be negative, got {quantity}")
        return value

    @property
    def gpu_count(self) -> int:
        if self.gpus is not None:
            return self.gpus
        raw = self.limits.get("nvidia.com/gpu", 0)
        return int(raw)


FieldType = Literal["string", "int32", "int64", "float32", "float64", "bool", "array", "object"]


class FieldSpec(_Strict):
    """One typed field of a request or response body."""

    name: str = Field(min_length=1, max_length=128)
    type: FieldType
    required: bool = True
    max_length: int | None = Field(
        default=None, ge=0, le=1_000_000_000, description="strings: characters; arrays: items"
    )
    min_length: int | None = Field(default=None, ge=0, le=1_000_000_000)
    range: tuple[float, float] | None = Field(default=None, description="numbers: inclusive [low, high]")
    enum: list[str | int | float] | None = Field(default=None, max_length=1000)

    @model_validator(mode="after")
    def _constraints_fit_type(self) -> FieldSpec:
        numeric = self.type in ("int32", "int64", "float32", "float64")
        sized = self.type in ("string", "array")
        if self.range is not None:
            if not numeric:
                raise ValueError(f"range applies to numbers, not to type {self.type}")
            if self.range[0] > self.range[1]:
                raise ValueError(f"range low {self.range[0]} is above high {self.range[1]}")
        if (self.max_length is not None or self.min_length is not None) and not sized:
            raise ValueError(f"max_length/min_length apply to strings and arrays, not to type {self.type}")
        if self.max_length is not None and self.min_length is not None and self.min_length > self.max_length:
            raise ValueError(f"min_length {self.min_length} is above max_length {self.max_length}")
        return self


class IOSchema(_Strict):
    type: Literal["json"] = "json"
    fields: list[FieldSpec] = Field(default_factory=list, max_length=256)
    allow_extra_fields: bool = Field(
        default=True, description="Bodies may carry fields the schema does not name (OpenAI bodies do)."
    )

    @field_validator("fields")
    @classmethod
    def _unique_names(cls, value: list[FieldSpec]) -> list[FieldSpec]:
        seen: set[str] = set()
        for item in value:
            if item.name in seen:
                raise ValueError(f"field {item.name!r} is declared twice")
            seen.add(item.name)
        return value


# Bounds that the resources a spec becomes can hold: Envoy durations, uint32 breaker thresholds
# (max_concurrent_requests x instances x 2 stays far below 2**32), and a fleet this control plane can run.
MAX_REPLICAS = 1000
# A whole ModelService, as JSON (its canonical form, to_dict), where it enters the cluster for node hosts
# to run (a file, the admin API; sie.spec_loader): it travels to and from them (sie.wire) and is kept in
# the state file. (A Kubernetes ModelService is bounded by its pods' annotation instead,
# xds_server.k8s.deployments.) A spec with 256 schema fields of long enums is under 100 KiB.
MAX_SPEC_BYTES = 256 * 1024
DAY_MS = 86_400_000.0


def _canonical_json(spec: dict[str, Any]) -> bytes:
    """A spec's compact JSON with sorted keys (of `ModelService.to_dict()`): what `spec_digest` hashes and
    `spec_size` measures. The stdlib's encoder: an engine setting may be an integer past 64 bits, which
    orjson refuses."""
    return json.dumps(spec, sort_keys=True, separators=(",", ":")).encode()


def spec_figures(spec: dict[str, Any]) -> tuple[str, int]:
    """(spec_digest, spec_size) of a spec, from one encoding of it."""
    text = _canonical_json(spec)
    return hashlib.sha256(text).hexdigest(), len(text)


def spec_digest(spec: dict[str, Any]) -> str:
    """A spec's name on the node wire (sie.wire): SHA-256 (hex) of its canonical JSON."""
    return spec_figures(spec)[0]


def spec_size(spec: dict[str, Any]) -> int:
    """A spec's canonical JSON size in bytes, as MAX_SPEC_BYTES and sie.wire.MAX_SPEC_BYTES_PER_BEAT count."""
    return len(_canonical_json(spec))


class SLA(_Strict):
    p99_latency_ms: float = Field(default=1000.0, gt=0, le=DAY_MS)
    max_queue_time_ms: float = Field(default=1000.0, ge=0, le=3_600_000.0)
    min_replicas: int = Field(default=1, ge=0, le=MAX_REPLICAS)
    max_replicas: int = Field(default=1, ge=1, le=MAX_REPLICAS)
    request_timeout_ms: float | None = Field(
        default=None, gt=0, le=DAY_MS, description="Envoy route timeout; default max(15 s, 10 x p99 + max queue time)."
    )

    @model_validator(mode="before")
    @classmethod
    def _max_defaults_to_min(cls, data: Any) -> Any:
        if isinstance(data, dict) and "max_replicas" not in data and "maxReplicas" not in data:
            low = data.get("min_replicas", data.get("minReplicas"))
            if isinstance(low, int) and low > 1:
                data = {**data, "max_replicas": low}
        return data

    @model_validator(mode="after")
    def _replicas_ordered(self) -> SLA:
        if self.min_replicas > self.max_replicas:
            raise ValueError(f"min_replicas ({self.min_replicas}) is above max_replicas ({self.max_replicas})")
        return self

    @property
    def route_timeout_ms(self) -> float:
        if self.request_timeout_ms is not None:
            return self.request_timeout_ms
        return min(DAY_MS, max(15_000.0, 10 * self.p99_latency_ms + self.max_queue_time_ms))


class Toleration(_Strict):
    key: str | None = None
    operator: Literal["Equal", "Exists"] = "Equal"
    value: str | None = None
    effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute"] | None = None
    toleration_seconds: int | None = Field(default=None, ge=0, le=2**31 - 1, alias="tolerationSeconds")


class Scheduling(_Strict):
    node_selector: dict[str, str] = Field(default_factory=dict, alias="nodeSelector")
    tolerations: list[Toleration] = Field(default_factory=list)
    tier: str | None = Field(
        default=None, description="A named pool; a tier reserved for P0 refuses P1/P2 models with 409."
    )


class HTTPGetAction(_Strict):
    path: str = Field(default="/health", max_length=1024)
    port: int | str = Field(default=3000)


class Probe(_Strict):
    http_get: HTTPGetAction = Field(default_factory=HTTPGetAction, alias="httpGet")
    initial_delay_seconds: int = Field(default=0, ge=0, le=86_400, alias="initialDelaySeconds")
    period_seconds: int = Field(default=10, ge=1, le=3600, alias="periodSeconds")
    timeout_seconds: int = Field(default=1, ge=1, le=3600, alias="timeoutSeconds")
    failure_threshold: int = Field(default=3, ge=1, le=1000, alias="failureThreshold")
    success_threshold: int = Field(default=1, ge=1, le=1000, alias="successThreshold")


class Health(_Strict):
    liveness: Probe | None = Field(default=None, alias="livenessProbe")
    readiness: Probe | None = Field(default=None, alias="readinessProbe")


class KafkaInput(_Strict):
    """Consume requests from a Kafka topic and produce results (the source article's scenario 4.2).

    Each instance's sidecar joins `group_id`, so the topic's partitions spread over the instances. Offsets
    are committed only after the result is acknowledged by the broker: at-least-once, never lost.
    """

    bootstrap_servers: list[str] = Field(min_length=1, description="host:port of one or more brokers")
    topic: str = Field(min_length=1, max_length=249, pattern=r"^[a-zA-Z0-9._-]+$")
    group_id: str = Field(min_length=1)
    output_topic: str = Field(min_length=1, max_length=249, pattern=r"^[a-zA-Z0-9._-]+$")
    dead_letter_topic: str | None = Field(default=None, max_length=249, pattern=r"^[a-zA-Z0-9._-]+$")
    auto_offset_reset: Literal["earliest", "latest"] = "earliest"
    value_deserializer: Literal["json"] = "json"
    max_in_flight: int = Field(
        default=1024,
        ge=1,
        le=100_000,
        description="Messages between fetch and the broker's acknowledgement of their results, over all partitions.",
    )
    max_batch: int = Field(
        default=256,
        ge=1,
        le=10_000,
        description="Most messages scored in one worker call (of one fetch, over its partitions); 1 calls the worker per message.",
    )
    max_record_bytes: int | None = Field(
        default=None,
        ge=4096,
        le=64 << 20,
        description=(
            "Largest record written to output_topic and dead_letter_topic, counted as a batch holding it alone "
            "(bytes; default 1,048,588, Kafka's default message.max.bytes): set it to those topics' "
            "max.message.bytes when lower. A result over it is dead-lettered instead, a dead letter over it "
            "replaced by a stub without the request's bytes."
        ),
    )

    @field_validator("bootstrap_servers", mode="before")
    @classmethod
    def _split_servers(cls, value: Any) -> Any:
        if isinstance(value, str):
            value = [part.strip() for part in value.split(",") if part.strip()]
        return value

    @field_validator("bootstrap_servers")
    @classmethod
    def _host_port(cls, value: list[str]) -> list[str]:
        for item in value:
            host, _, port = item.rpartition(":")
            if not host or not (port.isascii() and port.isdigit()) or not 0 < int(port) < 65536:
                raise ValueError(f"{item!r} is not host:port")
        return value

    @model_validator(mode="after")
    def _distinct_topics(self) -> KafkaInput:
        if self.output_topic == self.topic:
            raise ValueError("output_topic must differ from topic (results would be consumed as requests)")
        if self.dead_letter_topic in (self.topic, self.output_topic):
            raise ValueError("dead_letter_topic must differ from topic and output_topic")
        return self


# The public inference API per service type (DESIGN §10): the only paths the ingress routes to a model and
# the only ones its sidecar forwards. Everything else a worker serves is a control endpoint.
INFERENCE_PATHS: dict[ServiceType, tuple[str, ...]] = {
    ServiceType.LLM: ("/v1/chat/completions", "/v1/completions", "/generate"),
    ServiceType.EMBEDDING: ("/v1/embeddings", "/infer"),
    ServiceType.SCORING: ("/infer",),
    ServiceType.NER: ("/infer",),
    ServiceType.CLASSIFICATION: ("/infer",),
}
# Prefixes of control endpoints (SIE's sidecar and workers, SGLang, vLLM, the simulator): a spec can
# never add one of these as an inference path.
CONTROL_PATH_PREFIXES = (
    "/-/",
    "/sim",
    "/release",
    "/resume",
    "/flush",
    "/abort",
    "/update_weights",
    "/v1/loads",
    "/loads",
    "/metrics",
    "/server_info",
    "/get_",
    "/set_",
    "/health",
    "/model_info",
    "/v1/models",
    "/pause",
    "/continue",
    "/load_lora",
    "/unload_lora",
    "/start",
    "/stop",
    "/configure",
    "/slow_down",
    "/dump",
    "/debug",
    "/admin",
    "/internal",
    "/profile",
    "/sleep",
    "/wake",
    "/is_sleeping",
    "/reset",
    "/collective",
    "/init_weights",
    "/v1/load_lora",
    "/v1/unload_lora",
    "/tokenize",
    "/detokenize",
    "/version",
    "/ping",
    "/drain",
    "/state",
    "/v1/status",
    "/v1/endpoints",
    "/v1/nodes",
    "/v1/telemetry",
    "/v1/prometheus",
)
_EXTRA_PATH = re.compile(r"^/[a-z0-9][a-z0-9_-]*(/[a-z0-9][a-z0-9_.-]*)*$")


def control_path_problem(path: str) -> str | None:
    """Why `path` may not be an inference path (it names a control endpoint, or is not a plain path)."""
    if len(path) > 128 or not _EXTRA_PATH.match(path) or "/." in path:
        return (
            f"{path[:128]!r} is not a plain lowercase path such as /v1/rerank (letters, digits, - _ . "
            "between slashes, no '..', at most 128 characters)"
        )
    for prefix in CONTROL_PATH_PREFIXES:
        if path == prefix.rstrip("/") or path.startswith(prefix):
            return f"{path!r} names a control endpoint ({prefix}...); only inference paths can be routed to a model"
    return None


class PrefixAffinity(_Strict):
    """Requests that share the start of their prompt (a system prompt, few-shot examples, a conversation
    so far) go to the instance that already holds it in its prefix cache, until that instance has more
    than `balance_factor` times its share of the model's requests in flight (its share by SIE's weights);
    then to the next best (SIE's endpoint picker, xds_server/picker). SIE's weights, draining, shedding and priorities apply
    as for any model; without a picker running, the model is balanced by load alone."""

    enabled: bool | None = Field(
        default=None, description="On or off; unset: on for service_type llm, off for the others."
    )
    balance_factor: float = Field(
        default=1.5,
        ge=1.0,
        le=10.0,
        description="No instance is picked for its cached prefix while it has more than this many times its "
        "share of the model's requests in flight, by SIE's weights (plus one).",
    )


class Routing(_Strict):
    """How the ingress reaches this model beyond the paths of its service type."""

    prefix_affinity: PrefixAffinity = Field(default_factory=PrefixAffinity)

    inference_paths: list[str] = Field(
        default_factory=list,
        max_length=16,
        description="Extra POST paths of this model's public API (e.g. /v1/rerank); never a control path.",
    )
    retry_on_worker_loss: bool = Field(
        default=True,
        description="Retry a non-streaming request on another instance when its worker died "
        "before any byte of the answer reached the client (inference has no side effects).",
    )

    @field_validator("inference_paths")
    @classmethod
    def _paths_are_inference_paths(cls, value: list[str]) -> list[str]:
        for path in value:
            problem = control_path_problem(path)
            if problem:
                raise ValueError(problem)
        if len(set(value)) != len(value):
            raise ValueError("a path is listed twice")
        return value


class Limits(_Strict):
    """What one request may ask of this model; checked by the sidecar, and again by the worker."""

    max_new_tokens: int | None = Field(
        default=None,
        ge=1,
        le=1_000_000,
        description="Most tokens a request may ask to generate, under every spelling: max_tokens, "
        "max_completion_tokens and SGLang's sampling_params.max_new_tokens (default: no bound beyond "
        "the context, backend.config.max_seq_len).",
    )
    max_body_bytes: int = Field(
        default=4 * 1024 * 1024,
        ge=1024,
        le=64 * 1024 * 1024,
        description="Largest request body the sidecar accepts (413 above it).",
    )


class RolloutGates(_Strict):
    """What a new version must show, on its own traffic, before its share grows (xds_server.rollout).

    Each version's figures come from its sidecars' sliding windows, pooled over its instances: p99 is the
    request-weighted mean of the instances' window p99s, the error rate is errors over requests (5xx
    answers; a 4xx is the client's), queue time the largest instance p99 queue wait. A gate is judged only
    once both versions have `min_requests` answers in their windows; until then the step waits."""

    p99_within_sla: bool = Field(default=True, description="the new version's p99 <= sla.p99_latency_ms")
    max_p99_ratio: float | None = Field(
        default=1.5, ge=1.0, le=100.0, description="new p99 <= this x the old version's p99 (None: not gated)"
    )
    p99_slack_ms: float = Field(
        default=5.0, ge=0, le=DAY_MS, description="absolute slack on the ratio, so millisecond noise never gates"
    )
    max_error_rate_increase: float | None = Field(
        default=0.01, ge=0, le=1, description="new error rate <= the old version's + this (None: not gated)"
    )
    queue_time_within_sla: bool = Field(default=True, description="new p99 queue wait <= sla.max_queue_time_ms")
    min_requests: int = Field(
        default=100, ge=1, le=1_000_000, description="answers each version needs before a gate is judged"
    )


class AutoscalePolicy(_Strict):
    """How SIE's autoscaler moves a model's replica count within [sla.min_replicas, sla.max_replicas]
    (xds_server/autoscale). It acts only when the bounds differ and `spec.replicas` is not set: a set
    `replicas` (by hand, `kubectl scale`, HPA or KEDA through the scale subresource) is an external
    scaler's decision, and SIE's autoscaler leaves that model alone."""

    target_concurrency: float | None = Field(
        default=None,
        gt=0,
        le=100_000,
        description="requests in flight (and queued) per instance to aim for; default 0.7 x max_concurrent_requests",
    )
    tolerance: float = Field(
        default=0.1, ge=0, le=1, description="no change while demand is within this fraction of the target"
    )
    scale_down_window_s: float = Field(
        default=60.0,
        ge=0,
        le=86_400,
        description="scale down only to the largest count recommended over this window (stabilisation)",
    )
    max_step_up: int = Field(default=4, ge=1, le=MAX_REPLICAS, description="instances added at most per decision")
    scale_down_headroom: float = Field(
        default=0.35,
        ge=0,
        lt=1,
        description=(
            "a scale-down to n instances needs the demand to fit them at (1 - this) x the target: the smaller "
            "fleet keeps this room, which covers each instance's concurrency rising more than in proportion "
            "as its requests slow with a larger batch (LLMs), so a scale-down is not taken back at once"
        ),
    )
    warm_pool: int = Field(
        default=1,
        ge=0,
        le=MAX_REPLICAS,
        description=(
            "instances kept loaded but asleep beyond the desired count (never beyond max_replicas), so that "
            "scaling up by that many is a wake, not a load; they hold host memory, no GPU memory"
        ),
    )
    idle_s: float = Field(
        default=300.0,
        gt=0,
        le=7 * 86_400,
        description="with sla.min_replicas 0: seconds without a request after which the last instance sleeps",
    )
    wake_timeout_s: float = Field(
        default=60.0,
        gt=0,
        le=3600,
        description="how long a request held for a model at zero waits for the wake before a retryable 503",
    )
    sleep_mode: Literal["offload", "unload"] = Field(
        default="offload",
        description=(
            "how an instance sleeps at zero and in the warm pool: offload keeps the weights in host memory "
            "(a wake copies them back); unload stops the worker and keeps only its sidecar (a wake is a load)"
        ),
    )


def rollout_sizes(
    replicas: int, prepared: int, live: int, max_surge: int | None, max_unavailable: int, yielded: int = 0
) -> tuple[int, int, int]:
    """(old, new, needed): instances of the old build and the new build a rollout runs while it prepares
    the step with share `prepared` (percent) and `live` is the share in the routes, and how many ready new
    ones that step needs (rollout_needed).

    The old build stays at full strength while replicas + max_surge (default max_surge: replicas) leaves
    room beside the new build's instances, so a rollback leaves it serving as before; where the surge is
    smaller it shrinks towards what its live share needs, ceil(replicas x old share). Less the instances
    it `yielded` where the nodes have no room for the new build's (xds_server.rollout.machine stops them
    one at a time, while max_unavailable allows, and never gives one back before the rollout ends). Never
    below one until the rollout ends: its share, or a rollback, needs a ready instance to go to. The new
    build gets what the step's share needs within replicas + max_surge."""
    n = max(1, replicas)
    wanted = share_instances(n, prepared)
    budget = n + (n if max_surge is None else max_surge)
    old = max(math.ceil(n * (100 - live) / 100), min(n, budget - wanted), 1)
    old = max(1, old - max(0, yielded))
    return old, min(wanted, max(0, budget - old)), rollout_needed(n, prepared, old, max_unavailable)


def rollout_needed(replicas: int, share: int, old: int, max_unavailable: int) -> int:
    """Ready new instances a step with `share` needs to go live, and keeps needing while it is live:
    ceil(replicas x share), at least one; but one fewer where that is every replica, the old build is
    down to its last instance (`old`) and max_unavailable allows one short. That instance stays until the
    rollout succeeds (see rollout_sizes), so on nodes with room for only the replicas the last new
    instance has none before then: the step goes live without it, and it starts in the old instance's
    room once the new build is promoted. The fleet is never more than that one short of the replicas."""
    n = max(1, replicas)
    wanted = share_instances(n, share)
    if wanted == n >= 2 and old <= 1 and max_unavailable >= 1:
        return n - 1
    return wanted


def share_instances(replicas: int, share: int) -> int:
    """The instances a share of traffic (percent) takes: ceil(replicas x share), at least one, at most all."""
    return min(replicas, max(1, math.ceil(replicas * share / 100)))


def rollout_problem(policy: RolloutPolicy, replicas: int) -> str | None:
    """Why `policy` could never finish for `replicas` instances within its own max_surge, even with every
    old instance max_unavailable lets stop, or None.

    While the first step is prepared no new instance serves, so at most max_unavailable old instances may
    stop for it: its new instances beyond max_surge need max_unavailable to cover them. From then on every
    old instance but the last may stop, one at a time as new ones become ready (ready old + ready new stay
    at least replicas - max_unavailable). A policy that can finish within its surge may still wait on
    nodes with less room than it allows: the machine then says what it waits for, and gives up at
    progress_deadline_s."""
    live = 0
    for step in policy.steps:
        if policy.max_unavailable == 0:
            yielded = 0
        else:
            yielded = policy.max_unavailable if live == 0 else replicas
        old, new, needed = rollout_sizes(replicas, step, live, policy.max_surge, policy.max_unavailable, yielded)
        if new < needed:
            surge = replicas if policy.max_surge is None else policy.max_surge
            return (
                f"with {replicas} replicas, step {step}% needs {needed} new instances while {live}% is live and "
                f"the old build keeps {old}: more than replicas + max_surge ({replicas + surge}); raise max_surge "
                "or max_unavailable, or add a smaller step"
            )
        live = step
    return None


class RolloutPolicy(_Strict):
    """How a changed version, image, path or backend of a running model goes live (DESIGN §11)."""

    steps: list[int] = Field(
        default_factory=lambda: [10, 20, 50, 100],
        min_length=1,
        max_length=20,
        description="the new version's share of traffic (percent) at each step, rising, ending at 100",
    )
    hold_s: float = Field(default=30.0, ge=0, le=86_400, description="seconds each step holds with its gates met")
    gates: RolloutGates = Field(default_factory=RolloutGates)
    max_surge: int | None = Field(
        default=None,
        ge=0,
        le=MAX_REPLICAS,
        description="instances beyond the replica count during a rollout (default: replicas, if memory allows)",
    )
    max_unavailable: int = Field(
        default=0,
        ge=0,
        le=MAX_REPLICAS,
        description=(
            "old instances that may stop before new ones are ready, when memory has no room to surge: one at a "
            "time, while the ready instances that serve stay at least replicas minus this"
        ),
    )
    auto_rollback: bool = Field(
        default=True, description="a breached gate or a passed deadline rolls back (False: it pauses)"
    )
    # No grace before a share with no ready instance is withdrawn (with none ready every request it sends
    # fails, so waiting only adds failures, and the share comes back as soon as they are ready), and a
    # long one before giving up, since a withdrawn share or a step not yet live costs no request: a
    # crash-restart is a backoff of at most 10 s (node_host/restarts.py) and a model load, a lost node 30 s
    # of heartbeat timeout, a re-place and a load, minutes for large weights. Ten minutes, as Kubernetes'
    # progressDeadlineSeconds. A build that never becomes ready (a worker that crash-loops, a bad model
    # path, no GPU memory for it) is given up on after this, instead of holding the rollout for ever.
    progress_deadline_s: float = Field(
        default=600.0,
        ge=1,
        le=86_400,
        description=(
            "seconds the new build may lack the ready instances a step needs (one being prepared, or a share "
            "in the routes) before the rollout gives up on it as on a breached gate (as progressDeadlineSeconds)"
        ),
    )
    # Its requests do not reach the new build (Envoy cannot connect to it, say) and fail where no sidecar
    # counts them. Four default sidecar windows (30 s): by chance, no answer at that rate for so long does
    # not happen. Under one window, a share may be given up on before its first answers are reported.
    starved_deadline_s: float = Field(
        default=120.0,
        ge=1,
        le=86_400,
        description=(
            "seconds a share in the routes may get no answer from the new build's ready instances while the old "
            "build's answers say it should have had gates.min_requests, before the rollout gives up as on a breach"
        ),
    )

    @field_validator("steps")
    @classmethod
    def _rising_to_100(cls, value: list[int]) -> list[int]:
        if any(not 0 < step <= 100 for step in value):
            raise ValueError(f"each step is a percentage in 1..100, got {value}")
        if any(b <= a for a, b in zip(value, value[1:])):
            raise ValueError(f"steps must rise, got {value}")
        if value[-1] != 100:
            raise ValueError(f"the last step must be 100, got {value[-1]}")
        return value


class Batching(_Strict):
    """Dynamic micro-batching of /infer requests in the worker (scorers: sklearn, any engine serving /infer).

    Requests that arrive while a batch runs, or in the same read of the sockets, run as one predict; a
    lone request runs at once. Ignored by generative engines, which batch tokens on their own.
    """

    max_batch_size: int = Field(
        default=256,
        ge=1,
        le=4096,
        description="Most rows in one engine call; 1 turns batching off (one predict per request).",
    )
    max_delay_ms: float = Field(
        default=1.0,
        ge=0,
        le=1000,
        description="Longest the first request of a batch waits for more while requests keep arriving (ms).",
    )


class ModelServiceSpec(_Strict):
    model: ModelInfo
    backend: Backend
    resources: Resources = Field(default_factory=Resources)
    input_schema: IOSchema | None = None
    output_schema: IOSchema | None = None
    sla: SLA = Field(default_factory=SLA)
    scheduling: Scheduling = Field(default_factory=Scheduling)
    health: Health = Field(default_factory=Health)
    kafka_input: KafkaInput | None = None
    batching: Batching = Field(default_factory=Batching)
    routing: Routing = Field(default_factory=Routing)
    limits: Limits = Field(default_factory=Limits)
    rollout: RolloutPolicy = Field(default_factory=RolloutPolicy)
    autoscale: AutoscalePolicy = Field(default_factory=AutoscalePolicy)
    replicas: int | None = Field(
        default=None,
        ge=0,
        le=MAX_REPLICAS,
        description="Instances to run; defaults to sla.min_replicas. Within min and max.",
    )

    @model_validator(mode="before")
    @classmethod
    def _probes_at_top_level(cls, data: Any) -> Any:
        # The Kubernetes habit puts livenessProbe/readinessProbe directly under spec; fold them into health.
        if isinstance(data, dict):
            moved = {k: data[k] for k in ("livenessProbe", "readinessProbe") if k in data}
            if moved:
                data = {k: v for k, v in data.items() if k not in moved}
                health = dict(data.get("health") or {})
                for key, value in moved.items():
                    if key in health or key.removesuffix("Probe") in health:
                        raise ValueError(f"{key} is given both under spec and under spec.health")
                    health[key] = value
                data["health"] = health
        return data

    @model_validator(mode="after")
    def _rollout_can_finish(self) -> ModelServiceSpec:
        problem = rollout_problem(self.rollout, self.desired_replicas)
        if problem is not None:
            raise ValueError(f"rollout: {problem}")
        return self

    @model_validator(mode="after")
    def _replicas_within_sla(self) -> ModelServiceSpec:
        if self.replicas is not None and not (self.sla.min_replicas <= self.replicas <= self.sla.max_replicas):
            raise ValueError(
                f"replicas ({self.replicas}) must lie within sla.min_replicas ({self.sla.min_replicas}) "
                f"and sla.max_replicas ({self.sla.max_replicas})"
            )
        return self

    @property
    def model_id(self) -> str:
        return self.model.name

    def build_identity(self) -> dict[str, Any]:
        """What makes a different build of the model: a change here is a rollout (DESIGN §11), any other
        change applies in place. Version, image, weights (path, sha256) and the backend with its config."""
        return {
            "version": self.model.version,
            "image": self.model.image,
            "path": self.model.path,
            "sha256": self.model.sha256,
            "backend": self.backend.model_dump(mode="json"),
        }

    @property
    def desired_replicas(self) -> int:
        return self.replicas if self.replicas is not None else self.sla.min_replicas

    @property
    def prefix_affinity(self) -> bool:
        """Whether requests go to the instance holding their prompt's prefix (routing.prefix_affinity;
        on by default for LLMs, whose prefill is what a cached prefix saves)."""
        enabled = self.routing.prefix_affinity.enabled
        return enabled if enabled is not None else self.model.service_type is ServiceType.LLM

    @property
    def autoscaled(self) -> bool:
        """SIE's autoscaler moves this model: its bounds differ and no `replicas` is set."""
        return self.replicas is None and self.sla.max_replicas > self.sla.min_replicas

    @property
    def max_new_tokens(self) -> int | None:
        """The token limit every spelling is held to: limits.max_new_tokens, and the upper bound of an
        input_schema range on max_tokens / max_completion_tokens / max_new_tokens (a range written for
        one spelling binds the others too)."""
        bounds = [self.limits.max_new_tokens] if self.limits.max_new_tokens is not None else []
        for f in self.input_schema.fields if self.input_schema else ():
            if f.name in ("max_tokens", "max_completion_tokens", "max_new_tokens") and f.range is not None:
                bounds.append(int(f.range[1]))
        return min(bounds) if bounds else None

    @property
    def inference_paths(self) -> tuple[str, ...]:
        """The POST paths of this model's public API: its service type's, then the spec's extras."""
        base = INFERENCE_PATHS[self.model.service_type]
        return base + tuple(p for p in self.routing.inference_paths if p not in base)


class ObjectMeta(BaseModel):
    model_config = ConfigDict(extra="allow", populate_by_name=True, frozen=True)

    name: str = Field(pattern=MODEL_ID_PATTERN)
    namespace: str | None = None
    labels: dict[str, str] = Field(default_factory=dict)
    annotations: dict[str, str] = Field(default_factory=dict)


class ModelService(_Strict):
    api_version: Literal["sie.io/v1alpha1"] = Field(default=API_VERSION, alias="apiVersion")
    kind: Literal["ModelService"] = KIND
    metadata: ObjectMeta
    spec: ModelServiceSpec
    status: dict[str, Any] | None = None

    @model_validator(mode="before")
    @classmethod
    def _name_defaults(cls, data: Any) -> Any:
        # metadata.name defaults to the model's name, and the two must agree when both are given.
        if isinstance(data, dict):
            spec = data.get("spec")
            model_name = (
                spec.get("model", {}).get("name")
                if isinstance(spec, dict) and isinstance(spec.get("model"), dict)
                else None
            )
            meta = data.get("metadata")
            if meta is None and model_name is not None:
                data = {**data, "metadata": {"name": model_name}}
        return data

    @model_validator(mode="after")
    def _names_agree(self) -> ModelService:
        if self.metadata.name != self.spec.model.name:
            raise ValueError(
                f"metadata.name ({self.metadata.name!r}) differs from spec.model.name ({self.spec.model.name!r}); "
                "they name the same model and must be equal"
            )
        return self

    @property
    def model_id(self) -> str:
        return self.spec.model.name

    def to_dict(self) -> dict[str, Any]:
        """The canonical JSON form (aliases where Kubernetes uses them), suitable for reloading."""
        return self.model_dump(mode="json", by_alias=True, exclude_none=True)


ModelIdStr = Annotated[str, Field(pattern=MODEL_ID_PATTERN)]


def is_model_id(value: str) -> bool:
    return bool(_MODEL_ID_RE.match(value))
