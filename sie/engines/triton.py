"""Triton Inference Server's dialect (`backend.type: triton`), as tritonserver 2.51 has it (the binary
PyPI's nvidia-pytriton 0.7.0 ships; measured against it in tests/integration/test_triton_real.py).

- one model per server, loaded by SIE's node host (node_host/backends/triton_server/), answering the
  KServe v2 protocol: SIE's `/infer` goes to `/v2/models/{model}/infer` through `TritonCodec`, which
  turns SIE's rows into one tensor of shape [n, 1] per input field and the output tensors back into rows;
- readiness is the model's own, `GET /v2/models/{model}/ready`: 200 once it is loaded, 400 ("Model
  version not ready") while it is not, so an unloaded (sleeping) model reads as not serving;
- Triton has no `/v1/loads`, and its metrics are on a port of their own (`--metrics-port`; the sidecar is
  given that URL): `nv_inference_pending_request_count` is the requests waiting for an execution. 2.51
  has no gauge of requests executing (its `nv_inference_exec_count` and `nv_inference_count` are
  counters since the start), so `running` stays None (unknown) and the sidecar's own in-flight count is
  the figure. An unloaded model's `nv_inference_*` lines vanish: waiting is then 0;
- the worker key: `--http-restricted-api` makes every API but health answer 403 unless the header
  `KEY_HEADER` carries the key (its whole value; Triton compares the header's value);
- sleep, on a GPU and on a CPU alike: the repository API unloads the model (its memory freed, the server
  kept running; a few ms) and loads it again (0.9-1.4 s for the demo scorer, measured), a call each;
- Triton's errors in SIE's one shape: its 400 (inputs it refuses, a batch over max_batch_size, a missing
  value the model refuses) stays a 400 `bad_request`; 404 (the model unloaded) and 503 are 503
  `unavailable`; 500 (the model's execute failed) is 500 `worker_error`; 401/403 (the key), any other
  status, and a 200 that is not the answer to the request sent are 502 `worker_error`.

Pure: values and functions of values (what it sends and reads is bytes).
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from sie import strict_json
from sie.engines.dialect import Call, Dialect, MemoryRelease, Sleep
from sie.errors import InputError, error_bytes
from sie.spec import FieldSpec, ModelService
from sie.worker_loads import EngineLoad, LoadsFormatError

# The KServe v2 datatype of each scalar field type a Triton model takes or gives; config.pbtxt spells it
# TYPE_<datatype> (BYTES as TYPE_STRING). Arrays and objects have no column of their own: refused.
DATATYPES: Mapping[str, str] = {
    "string": "BYTES",
    "float32": "FP32",
    "float64": "FP64",
    "int32": "INT32",
    "int64": "INT64",
    "bool": "BOOL",
}
# The fields of a scorer without schemas: SIE's sklearn engine's (node_host/backends/sklearn_engine/scorer_io.py).
DEFAULT_INPUT = (FieldSpec(name="text", type="string"),)
DEFAULT_OUTPUT = (FieldSpec(name="score", type="float32", range=(0.0, 1.0)),)
LABEL = "label"  # an output field of this name, after the first, gets the predicted class

KEY_HEADER = "x-sie-worker-key"
PENDING = "nv_inference_pending_request_count"
INFER_PATH = "/v2/models/{model}/infer"
# The `id` of a v2 request, which Triton echoes in its answer: how the answer knows the request's form.
ROW_ID = "sie-row"
INSTANCES_ID = "sie-instances"
MAX_ANSWER_BYTES = 256 * 1024**2  # a Triton answer SIE reads whole: 4096 rows of any scorer fit many times
_INT_BOUNDS = {"int32": (-(2**31), 2**31 - 1), "int64": (-(2**63), 2**63 - 1)}
_FP32_MAX = 3.4028234663852886e38


def input_fields(service: ModelService) -> tuple[FieldSpec, ...]:
    schema = service.spec.input_schema
    return tuple(schema.fields) if schema and schema.fields else DEFAULT_INPUT


def output_fields(service: ModelService) -> tuple[FieldSpec, ...]:
    schema = service.spec.output_schema
    return tuple(schema.fields) if schema and schema.fields else DEFAULT_OUTPUT


def produced_outputs(outputs: Sequence[FieldSpec]) -> tuple[FieldSpec, ...]:
    """The output fields SIE's scorer model fills, as SIE's sklearn engine does: the first (the score) and a
    later one named `label` (the predicted class). The others are declared in config.pbtxt but not asked for."""
    label = next((f for f in outputs[1:] if f.name == LABEL), None)
    return (outputs[0],) if label is None else (outputs[0], label)


def is_text_input(fields: Sequence[FieldSpec]) -> bool:
    """One string field: the estimator takes the texts (as SIE's sklearn engine decides)."""
    return len(fields) == 1 and fields[0].type == "string"


def parse_triton_metrics(text: str) -> EngineLoad:
    """Triton's Prometheus text: waiting is nv_inference_pending_request_count summed over its label sets
    (one model, one version here); running is unknown (see the module docstring)."""
    pending: float | None = None
    triton = False
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            triton = triton or sample.name.startswith("nv_")
            if sample.name == PENDING and math.isfinite(sample.value):
                pending = (pending or 0.0) + sample.value
    if not triton:
        raise LoadsFormatError("no nv_* metrics in the text: not Triton's /metrics")
    return EngineLoad(running=None, waiting=int(pending) if pending is not None else 0)


class TritonCodec:
    """SIE's /infer JSON to a KServe v2 inference request and the answer back, for one model (InferCodec)."""

    def __init__(self, model_id: str, inputs: Sequence[FieldSpec], outputs: Sequence[FieldSpec]):
        unknown = [f"{f.name} ({f.type})" for f in (*inputs, *outputs) if f.type not in DATATYPES]
        if unknown:
            raise ValueError(f"the triton backend carries scalar fields only, not {', '.join(unknown)}")
        self.model_id = model_id
        self.inputs = tuple(inputs)
        self.outputs = produced_outputs(outputs)
        self._text = is_text_input(self.inputs)

    def request(self, doc: Mapping[str, Any]) -> bytes:
        batched = "instances" in doc
        rows = doc["instances"] if batched else [doc]
        if not isinstance(rows, list) or not rows or not all(isinstance(r, Mapping) for r in rows):
            raise InputError("bad_request", "instances: expected a non-empty list of objects")
        tensors = [
            {
                "name": spec.name,
                "datatype": DATATYPES[spec.type],
                "shape": [len(rows), 1],
                "data": [self._encode(row, i, spec) for i, row in enumerate(rows)],
            }
            for spec in self.inputs
        ]
        body = {
            "id": INSTANCES_ID if batched else ROW_ID,
            "inputs": tensors,
            "outputs": [{"name": spec.name} for spec in self.outputs],
        }
        # NaN stands for an optional float left out (the estimator decides, as in SIE's sklearn engine):
        # Triton's JSON reader takes the token NaN, which json writes with allow_nan.
        return json.dumps(body, separators=(",", ":"), ensure_ascii=False).encode()

    def _encode(self, row: Mapping[str, Any], i: int, spec: FieldSpec) -> Any:
        where = f"instances[{i}].{spec.name}"
        value = row.get(spec.name)
        if value is None:
            if spec.required or (self._text and spec.type == "string"):
                raise InputError("invalid_schema", f"{where}: required")
            if spec.type == "string":
                return ""  # not a feature: only a single string field is (is_text_input)
            if spec.type in ("float32", "float64"):
                return math.nan
            raise InputError(
                "invalid_schema",
                f"{where}: left out, and a Triton tensor of {spec.type} has no missing value; send the field",
            )
        if spec.type == "string":
            if not isinstance(value, str):
                raise InputError("invalid_schema", f"{where}: expected a string, got {_kind(value)}")
            return value
        if spec.type == "bool":
            if not isinstance(value, bool):
                raise InputError("invalid_schema", f"{where}: expected true or false, got {_kind(value)}")
            return value
        if not isinstance(value, (int, float)):
            raise InputError("invalid_schema", f"{where}: expected a number, got {_kind(value)}")
        if spec.type in _INT_BOUNDS:
            low, high = _INT_BOUNDS[spec.type]
            if isinstance(value, float) and not value.is_integer():
                raise InputError("invalid_schema", f"{where}: expected an integer, got {value!r}")
            integer = int(value)
            if not low <= integer <= high:
                raise InputError("invalid_schema", f"{where}: {_shown(integer)} does not fit in {spec.type}")
            return integer
        real = float(value)
        if not math.isfinite(real) or (spec.type == "float32" and abs(real) > _FP32_MAX):
            raise InputError("invalid_schema", f"{where}: {value!r} does not fit in {spec.type}")
        return real

    def response(self, status: int, body: bytes) -> tuple[int, bytes]:
        if status != 200:
            return self._error(status, body)
        try:
            doc = strict_json.loads_object(body, max_bytes=MAX_ANSWER_BYTES, what="Triton's answer")
            return 200, json.dumps(self._answer(doc), separators=(",", ":"), ensure_ascii=False).encode()
        except (InputError, _Malformed) as exc:
            return 502, error_bytes(
                "worker_error",
                f"Triton's answer for model {self.model_id!r} is not a v2 inference answer: {exc}",
                model=self.model_id,
            )

    def _answer(self, doc: Mapping[str, Any]) -> Any:
        answer_id = doc.get("id")
        if answer_id not in (ROW_ID, INSTANCES_ID):
            raise _Malformed(f"its id is {_shown(answer_id)}, not the request's ({ROW_ID!r} or {INSTANCES_ID!r})")
        tensors = doc.get("outputs")
        if not isinstance(tensors, list):
            raise _Malformed("it has no outputs list")
        by_name = {t.get("name"): t for t in tensors if isinstance(t, dict)}
        columns: list[list[Any]] = []
        rows = None
        for spec in self.outputs:
            tensor = by_name.get(spec.name)
            if tensor is None:
                raise _Malformed(f"it has no output {spec.name!r}")
            values = _column(tensor, spec)
            if rows is not None and len(values) != rows:
                raise _Malformed(f"output {spec.name!r} has {len(values)} rows, the others {rows}")
            rows = len(values)
            columns.append(values)
        if not rows:
            raise _Malformed("it has no rows")
        out = [{spec.name: column[i] for spec, column in zip(self.outputs, columns)} for i in range(rows)]
        if answer_id == ROW_ID:
            if rows != 1:
                raise _Malformed(f"it has {rows} rows for a request of one")
            return out[0]
        return {"predictions": out}

    def _error(self, status: int, body: bytes) -> tuple[int, bytes]:
        said = _triton_message(body)
        if status == 400:  # Triton refused the request itself: its inputs, or a batch over max_batch_size
            return 400, error_bytes(
                "bad_request", f"model {self.model_id!r} refused the request: {said}", model=self.model_id
            )
        if status == 404 or status == 503:  # 404: "unknown model ... has no available versions": unloaded
            return 503, error_bytes(
                "unavailable",
                f"model {self.model_id!r} is not loaded in its Triton server (asleep, or loading): {said}",
                model=self.model_id,
            )
        if status in (401, 403):
            return 502, error_bytes(
                "worker_error",
                f"the Triton server of model {self.model_id!r} refused the worker key (HTTP {status}): "
                "the sidecar's key and the server's --http-restricted-api differ",
                model=self.model_id,
            )
        if status == 500:  # the model's execute failed (an exception, or an error response)
            return 500, error_bytes(
                "worker_error", f"model {self.model_id!r} failed the request: {said}", model=self.model_id
            )
        return 502, error_bytes(
            "worker_error", f"Triton answered HTTP {status} for model {self.model_id!r}: {said}", model=self.model_id
        )


class _Malformed(ValueError):
    """Triton's answer is JSON but not the answer to the request that was sent."""


def _column(tensor: Mapping[str, Any], spec: FieldSpec) -> list[Any]:
    shape, data = tensor.get("shape"), tensor.get("data")
    if (
        not isinstance(shape, list)
        or not shape
        or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape)
        or not isinstance(data, list)
    ):
        raise _Malformed(f"output {spec.name!r} has no [rows, 1] shape and data list")
    rows = shape[0]
    if math.prod(shape) != rows or len(data) != rows:
        raise _Malformed(f"output {spec.name!r} has shape {shape} and {len(data)} values; SIE asked for [rows, 1]")
    return [_value(v, spec) for v in data]


def _value(value: Any, spec: FieldSpec) -> Any:
    """One output value in its field's type, clamped to its range (as SIE's sklearn engine converts)."""
    if spec.type == "string":
        if not isinstance(value, str):
            raise _Malformed(f"output {spec.name!r} holds {_kind(value)}, not a string")
        return value
    if spec.type == "bool":
        if isinstance(value, bool):
            return value
        if isinstance(value, (int, float)):
            return value >= 0.5
        raise _Malformed(f"output {spec.name!r} holds {_kind(value)}, not true or false")
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise _Malformed(f"output {spec.name!r} holds {_kind(value)}, not a number")
    number = float(value)
    if spec.range is not None:
        number = min(max(number, spec.range[0]), spec.range[1])
    return int(round(number)) if spec.type in _INT_BOUNDS else number


def _triton_message(body: bytes) -> str:
    """What Triton said in its error body ({"error": "..."}), first paragraph only: a model's exception
    carries its traceback ("\\n\\nAt:\\n  /path/model.py(12)"), which names internals."""
    try:
        doc = strict_json.loads(body, max_bytes=1024**2, what="Triton's error")
        said = doc.get("error") if isinstance(doc, dict) else None
        text = said if isinstance(said, str) else body.decode("utf-8", "replace")
    except InputError:
        text = body[:1024].decode("utf-8", "replace")
    text = " ".join(text.split("\n\n", 1)[0].split())
    return (text[:300] + "...") if len(text) > 300 else text or "(no message)"


_ERROR_KINDS = {400: "bad_request", 404: "not_found", 503: "unavailable"}


def triton_error(status: int, body: bytes) -> bytes:
    """Any other Triton error answer ({"error": "..."}) in SIE's one error shape, its status kept
    (Dialect.error_shape); /infer's go through TritonCodec.response, which also maps the status."""
    return error_bytes(
        _ERROR_KINDS.get(status, "worker_error"), f"Triton answered HTTP {status}: {_triton_message(body)}"
    )


def _kind(value: Any) -> str:
    return "nothing" if value is None else type(value).__name__


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 64 else text[:61] + "..."


def codec(service: ModelService) -> TritonCodec:
    """The codec of one model (Dialect.codec)."""
    return TritonCodec(service.model_id, input_fields(service), output_fields(service))


_UNLOAD = Sleep(
    MemoryRelease.CALL,
    "Triton unloads the model through its repository API (its memory freed, the server kept running); "
    "a wake loads it again from the model repository",
    Call("/v2/repository/models/{model}/unload"),
    Call("/v2/repository/models/{model}/load"),
)

TRITON = Dialect(
    name="triton",
    health_path="/v2/models/{model}/ready",
    loads_path=None,
    metrics_path="/metrics",
    metrics_apart=True,
    parse_metrics=parse_triton_metrics,
    serves=frozenset({"/infer"}),
    sleep_on_gpu=_UNLOAD,
    sleep_on_cpu=_UNLOAD,
    targets={"/infer": INFER_PATH},
    key_header=KEY_HEADER,
    error_shape=triton_error,
    codec=codec,
)
