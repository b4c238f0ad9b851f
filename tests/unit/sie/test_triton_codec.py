"""Triton's dialect: SIE's /infer rows to a KServe v2 request and the answer back (TritonCodec), Triton's
errors in SIE's one error shape, its metrics text read as load figures, and the dialect's paths."""

from __future__ import annotations

import json
import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from sie.engines.dialect import MemoryRelease
from sie.engines.triton import (
    INSTANCES_ID,
    ROW_ID,
    TRITON,
    TritonCodec,
    codec,
    parse_triton_metrics,
    triton_error,
)
from sie.errors import InputError
from sie.spec import FieldSpec, ModelService
from sie.worker_loads import LoadsFormatError
from sie_testing import error_shape


def _service(inputs=None, outputs=None) -> ModelService:
    spec: dict = {
        "model": {"name": "scorer", "path": "m.skops", "service_type": "scoring"},
        "backend": {"type": "triton"},
    }
    if inputs is not None:
        spec["input_schema"] = {"fields": inputs}
    if outputs is not None:
        spec["output_schema"] = {"fields": outputs}
    return ModelService.model_validate({"spec": spec})


TEXT = _service()  # the defaults: {"text": string} in, {"score": float32 in [0, 1]} out
MIXED = _service(
    inputs=[
        {"name": "text", "type": "string"},
        {"name": "amount", "type": "float32"},
        {"name": "ratio", "type": "float64", "required": False},
        {"name": "count", "type": "int32"},
        {"name": "big", "type": "int64"},
        {"name": "flag", "type": "bool"},
        {"name": "note", "type": "string", "required": False},
    ],
    outputs=[
        {"name": "score", "type": "float64", "range": [0.0, 1.0]},
        {"name": "extra", "type": "string"},  # declared, but SIE's scorer model does not fill it
        {"name": "label", "type": "string"},
    ],
)


def _request(service: ModelService, doc: dict) -> dict:
    return json.loads(codec(service).request(doc))


def _answer(outputs: list[dict], answer_id: str = INSTANCES_ID) -> bytes:
    return json.dumps({"id": answer_id, "model_name": "scorer", "model_version": "1", "outputs": outputs}).encode()


def _tensor(name: str, datatype: str, data: list) -> dict:
    return {"name": name, "datatype": datatype, "shape": [len(data), 1], "data": data}


# ---- requests ---------------------------------------------------------------------------------------------


def test_one_row_is_a_batch_of_one_with_the_rows_id():
    assert _request(TEXT, {"text": "great service"}) == {
        "id": ROW_ID,
        "inputs": [{"name": "text", "datatype": "BYTES", "shape": [1, 1], "data": ["great service"]}],
        "outputs": [{"name": "score"}],
    }


def test_instances_are_one_column_per_field_in_row_order():
    rows = [
        {"text": "a", "amount": 1, "ratio": 0.5, "count": 3, "big": 2**40, "flag": True, "note": "n"},
        {"text": "b\u00e9", "amount": 2.5, "count": -1, "big": -(2**63), "flag": False},
    ]
    body = _request(MIXED, {"instances": rows})
    assert body["id"] == INSTANCES_ID
    columns = {t["name"]: (t["datatype"], t["shape"], t["data"]) for t in body["inputs"]}
    assert columns["text"] == ("BYTES", [2, 1], ["a", "b\u00e9"])
    assert columns["amount"] == ("FP32", [2, 1], [1.0, 2.5])
    assert columns["ratio"][:2] == ("FP64", [2, 1])
    assert columns["ratio"][2][0] == 0.5 and math.isnan(columns["ratio"][2][1])  # left out: NaN
    assert columns["count"] == ("INT32", [2, 1], [3, -1])
    assert columns["big"] == ("INT64", [2, 1], [2**40, -(2**63)])
    assert columns["flag"] == ("BOOL", [2, 1], [True, False])
    assert columns["note"] == ("BYTES", [2, 1], ["n", ""])  # not a feature: empty when left out
    assert [t["name"] for t in body["inputs"]] == [f.name for f in MIXED.spec.input_schema.fields]
    assert body["outputs"] == [{"name": "score"}, {"name": "label"}]  # what SIE's scorer model fills


def test_the_request_is_json_triton_reads_with_nan_for_a_missing_float():
    raw = codec(MIXED).request({"text": "a", "amount": 1, "count": 1, "big": 1, "flag": True})
    assert b'"data":[NaN]' in raw  # Triton's reader takes the NaN token (measured against 2.51)


@pytest.mark.parametrize(
    "service, doc, where",
    [
        (TEXT, {"text": 5}, "instances[0].text: expected a string, got int"),
        (TEXT, {}, "instances[0].text: required"),
        (TEXT, {"instances": [{"text": "ok"}, {"text": None}]}, "instances[1].text: required"),
        (
            MIXED,
            {"text": "a", "amount": "1", "count": 1, "big": 1, "flag": True},
            "instances[0].amount: expected a number",
        ),
        (MIXED, {"text": "a", "amount": 1e39, "count": 1, "big": 1, "flag": True}, "does not fit in float32"),
        (MIXED, {"text": "a", "amount": 1, "count": 2**31, "big": 1, "flag": True}, "does not fit in int32"),
        (MIXED, {"text": "a", "amount": 1, "count": 1.5, "big": 1, "flag": True}, "expected an integer"),
        (
            MIXED,
            {"text": "a", "amount": 1, "count": 1, "big": 1, "flag": 1},
            "instances[0].flag: expected true or false",
        ),
        (MIXED, {"text": "a", "amount": 1, "count": 1, "big": 1}, "instances[0].flag: required"),
        (MIXED, {"text": "a", "amount": 1, "count": 1, "big": 1, "flag": True, "note": 3}, "instances[0].note"),
    ],
)
def test_a_value_that_cannot_be_encoded_is_the_requests_400_naming_the_field(service, doc, where):
    with pytest.raises(InputError) as caught:
        codec(service).request(doc)
    assert caught.value.status == 400 and caught.value.kind == "invalid_schema"
    assert where in str(caught.value)


def test_an_optional_integer_left_out_has_no_missing_value_in_a_tensor():
    service = _service(inputs=[{"name": "n", "type": "int64", "required": False}])
    with pytest.raises(InputError, match="instances\\[0\\].n: left out"):
        codec(service).request({})


@pytest.mark.parametrize("instances", [[], "rows", [1], [{"text": "a"}, ["b"]]])
def test_instances_must_be_a_non_empty_list_of_objects(instances):
    with pytest.raises(InputError, match="non-empty list of objects") as caught:
        codec(TEXT).request({"instances": instances})
    assert caught.value.kind == "bad_request"


def test_fields_without_a_tensor_type_cannot_make_a_codec():
    service = _service(inputs=[{"name": "v", "type": "array"}])
    with pytest.raises(ValueError, match="scalar fields only"):
        codec(service)


# ---- answers ------------------------------------------------------------------------------------------------

ROUND_TRIPS = [
    # (service, request doc, Triton's output tensors, SIE's answer)
    (TEXT, {"text": "great"}, [_tensor("score", "FP32", [0.9495094418525696])], {"score": 0.9495094418525696}),
    (
        TEXT,
        {"instances": [{"text": "bad"}, {"text": "good"}]},
        [_tensor("score", "FP32", [0.043408289551734927, 0.9148916602134705])],
        {"predictions": [{"score": 0.043408289551734927}, {"score": 0.9148916602134705}]},
    ),
    (
        TEXT,
        {"instances": [{"text": "one"}]},  # a batch of one stays a batch
        [_tensor("score", "FP32", [0.5])],
        {"predictions": [{"score": 0.5}]},
    ),
    (
        TEXT,
        {"text": "beyond"},  # clamped to the output's range, as SIE's sklearn engine does
        [_tensor("score", "FP32", [1.5])],
        {"score": 1.0},
    ),
    (
        MIXED,
        {"instances": [{"text": "a", "amount": 1, "count": 1, "big": 1, "flag": True}] * 2},
        [_tensor("label", "BYTES", ["spam", "ham"]), _tensor("score", "FP64", [-0.5, 0.25])],  # any order
        {"predictions": [{"score": 0.0, "label": "spam"}, {"score": 0.25, "label": "ham"}]},
    ),
    (
        _service(outputs=[{"name": "hit", "type": "bool"}, {"name": "label", "type": "int64"}]),
        {"instances": [{"text": "a"}, {"text": "b"}]},
        [_tensor("hit", "BOOL", [True, False]), _tensor("label", "INT64", [1, 0])],
        {"predictions": [{"hit": True, "label": 1}, {"hit": False, "label": 0}]},
    ),
    (
        _service(outputs=[{"name": "stars", "type": "int32", "range": [1, 5]}]),
        {"instances": [{"text": "a"}, {"text": "b"}]},
        [_tensor("stars", "INT32", [7, 3])],
        {"predictions": [{"stars": 5}, {"stars": 3}]},
    ),
]


@pytest.mark.parametrize("service, doc, outputs, expected", ROUND_TRIPS)
def test_round_trip(service, doc, outputs, expected):
    translate = codec(service)
    sent = json.loads(translate.request(doc))
    status, body = translate.response(200, _answer(outputs, sent["id"]))
    assert status == 200
    answer = json.loads(body)
    assert answer == expected
    rows = answer.get("predictions", [answer])
    assert [{k: type(v) for k, v in row.items()} for row in rows] == [
        {k: type(v) for k, v in row.items()} for row in expected.get("predictions", [expected])
    ]  # 1.0 is not 1: each value in its field's type


def _score(data: list, shape: list | None = None, **extra) -> dict:
    return {"name": "score", "datatype": "FP32", "shape": shape or [len(data), 1], "data": data, **extra}


BAD_ANSWERS = [
    (b"not json", "not valid JSON"),
    (b"[1, 2]", "must be a JSON object"),
    (json.dumps({"outputs": [_score([0.5])]}).encode(), "its id is None"),
    (json.dumps({"id": "someone-else", "outputs": [_score([0.5])]}).encode(), "its id is 'someone-else'"),
    (json.dumps({"id": INSTANCES_ID}).encode(), "no outputs list"),
    (json.dumps({"id": INSTANCES_ID, "outputs": []}).encode(), "no output 'score'"),
    (json.dumps({"id": INSTANCES_ID, "outputs": [{"name": "score", "data": [0.5]}]}).encode(), "no [rows, 1] shape"),
    (json.dumps({"id": INSTANCES_ID, "outputs": [_score([0.5, 0.6], [2, 2])]}).encode(), "shape [2, 2]"),
    (json.dumps({"id": INSTANCES_ID, "outputs": [_score([0.5], [2, 1])]}).encode(), "shape [2, 1] and 1 values"),
    (json.dumps({"id": INSTANCES_ID, "outputs": [_score([], [0, 1])]}).encode(), "no rows"),
    (json.dumps({"id": INSTANCES_ID, "outputs": [_score(["high"])]}).encode(), "holds str, not a number"),
    (json.dumps({"id": INSTANCES_ID, "outputs": [_score([True])]}).encode(), "holds bool, not a number"),
    (json.dumps({"id": ROW_ID, "outputs": [_score([0.1, 0.2])]}).encode(), "2 rows for a request of one"),
    (b'{"id": "sie-row", "outputs": [{"name": "score", "shape": [1, 1], "data": [NaN]}]}', "not acceptable JSON"),
]


@pytest.mark.parametrize("body, reason", BAD_ANSWERS)
def test_a_malformed_answer_is_a_502_worker_error(body, reason):
    status, out = codec(TEXT).response(200, body)
    doc = json.loads(out)
    error_shape.check(status, doc)
    assert status == 502 and doc["error"]["type"] == "worker_error" and doc["error"]["model"] == "scorer"
    assert reason in doc["error"]["message"]


def test_outputs_of_different_lengths_are_malformed():
    translate = codec(_service(outputs=[{"name": "score", "type": "float32"}, {"name": "label", "type": "int32"}]))
    body = _answer([_score([0.1, 0.2]), _tensor("label", "INT32", [1])])
    status, out = translate.response(200, body)
    assert status == 502 and "has 1 rows, the others 2" in json.loads(out)["error"]["message"]


TRITON_ERRORS = [
    # (Triton's status, its body, SIE's status, SIE's type, in the message); the bodies are 2.51's own
    (
        400,
        {"error": "[request id: sie-row] inference request batch-size must be <= 8 for 'scorer'"},
        400,
        "bad_request",
        "batch-size must be <= 8",
    ),
    (
        400,
        {"error": "inference input 'text' data-type is 'FP32', but model 'scorer' expects 'BYTES'"},
        400,
        "bad_request",
        "expects 'BYTES'",
    ),
    (404, {"error": "Request for unknown model: 'scorer' has no available versions"}, 503, "unavailable", "not loaded"),
    (503, {"error": "Server not ready"}, 503, "unavailable", "Server not ready"),
    (
        403,
        {"error": "This API is restricted, expecting header 'x-sie-worker-key'"},
        502,
        "worker_error",
        "refused the worker key",
    ),
    (401, {"error": "no"}, 502, "worker_error", "refused the worker key"),
    (
        500,
        {
            "error": "Failed to process the request(s) for model 'scorer_0_0', message: ValueError: boom\n\nAt:\n  /run/repo/scorer/1/model.py(12): execute\n"
        },
        500,
        "worker_error",
        "message: ValueError: boom",
    ),
    (502, {"error": "upstream"}, 502, "worker_error", "HTTP 502"),
    (500, "plain text, not JSON", 500, "worker_error", "plain text, not JSON"),
    (500, {"error": 7}, 500, "worker_error", '"error": 7'),
    (400, {"error": "x" * 5000}, 400, "bad_request", "x" * 300 + "..."),
]


@pytest.mark.parametrize("status, body, sie_status, kind, said", TRITON_ERRORS)
def test_a_triton_error_is_sies_error_shape_with_the_right_status(status, body, sie_status, kind, said):
    raw = body.encode() if isinstance(body, str) else json.dumps(body).encode()
    out_status, out = codec(TEXT).response(status, raw)
    doc = json.loads(out)
    error_shape.check(out_status, doc)
    assert (out_status, doc["error"]["type"]) == (sie_status, kind)
    assert said in doc["error"]["message"] and doc["error"]["model"] == "scorer"
    assert "model.py" not in doc["error"]["message"]  # a traceback names internals: cut at "At:"


@pytest.mark.parametrize(
    "status, body, kind",
    [
        (400, b'{"error":"Model version not ready"}', "bad_request"),
        (404, b'{"error":"Request for unknown model: \'x\' is not found"}', "not_found"),
        (503, b'{"error":"Server not ready"}', "unavailable"),
        (403, b'{"error":"This API is restricted, expecting header \'x-sie-worker-key\'"}', "worker_error"),
        (500, b"<html>not json</html>", "worker_error"),
    ],
)
def test_other_triton_errors_take_sies_shape_with_their_message(status, body, kind):
    doc = json.loads(triton_error(status, body))
    error_shape.check(status, doc)
    assert doc["error"]["type"] == kind and doc["error"]["message"].startswith(f"Triton answered HTTP {status}: ")
    assert TRITON.error_shape is triton_error


@given(status=st.integers(100, 599), body=st.binary(max_size=300))
def test_any_answer_becomes_rows_or_sies_error_shape(status, body):
    out_status, out = codec(TEXT).response(status, body)
    doc = json.loads(out)
    if out_status == 200:
        assert "score" in doc or "predictions" in doc
    else:
        error_shape.check(out_status, doc)
    error_shape.check(status, json.loads(triton_error(status, body)))


@given(
    st.recursive(
        st.none() | st.booleans() | st.integers(-(2**40), 2**40) | st.floats(allow_nan=False) | st.text(max_size=10),
        lambda inner: (
            st.lists(inner, max_size=4)
            | st.dictionaries(st.sampled_from(["id", "outputs", "name", "shape", "data", "x"]), inner, max_size=5)
        ),
        max_leaves=30,
    )
)
def test_any_json_answer_becomes_rows_or_sies_error_shape(doc):
    out_status, out = codec(MIXED).response(200, json.dumps(doc).encode())
    answer = json.loads(out)
    if out_status != 200:
        error_shape.check(out_status, answer)


# ---- metrics, paths, sleep ----------------------------------------------------------------------------------

# GET :metrics-port/metrics of tritonserver 2.51 on this machine, with one model loaded.
METRICS_LOADED = """\
# HELP nv_inference_request_success Number of successful inference requests, all batch sizes
# TYPE nv_inference_request_success counter
nv_inference_request_success{model="scorer",version="1"} 4
# HELP nv_inference_count Number of inferences performed (does not include cached requests)
# TYPE nv_inference_count counter
nv_inference_count{model="scorer",version="1"} 9
# HELP nv_inference_exec_count Number of model executions performed (does not include cached requests)
# TYPE nv_inference_exec_count counter
nv_inference_exec_count{model="scorer",version="1"} 5
# HELP nv_inference_pending_request_count Instantaneous number of pending requests awaiting execution per-model.
# TYPE nv_inference_pending_request_count gauge
nv_inference_pending_request_count{model="scorer",version="1"} 3
# HELP nv_cpu_utilization CPU utilization rate [0.0 - 1.0]
# TYPE nv_cpu_utilization gauge
nv_cpu_utilization 0.005
"""
# The same server with the model unloaded: only the server's own gauges are left.
METRICS_UNLOADED = """\
# HELP nv_cpu_utilization CPU utilization rate [0.0 - 1.0]
# TYPE nv_cpu_utilization gauge
nv_cpu_utilization 0.01
# HELP nv_cpu_memory_used_bytes CPU used memory (RAM), in bytes
# TYPE nv_cpu_memory_used_bytes gauge
nv_cpu_memory_used_bytes 679993344
"""


@pytest.mark.parametrize(
    "text, waiting",
    [
        (METRICS_LOADED, 3),
        (METRICS_UNLOADED, 0),
        (
            METRICS_LOADED.replace(
                'version="1"} 3', 'version="1"} 3\nnv_inference_pending_request_count{model="scorer",version="2"} 2'
            ),
            5,
        ),
    ],
)
def test_waiting_is_triton_pending_requests_and_running_is_unknown(text, waiting):
    load = parse_triton_metrics(text)
    assert (load.running, load.waiting, load.kv_usage) == (None, waiting, None)


@pytest.mark.parametrize("text", ["", "sglang:num_running_reqs 1\n", "# just a comment\n"])
def test_text_that_is_not_tritons_is_refused(text):
    with pytest.raises(LoadsFormatError):
        parse_triton_metrics(text)


def test_the_dialect_routes_infer_to_the_models_v2_path_and_checks_its_readiness():
    assert TRITON.name == "triton" and TRITON.loads_path is None and TRITON.metrics_path == "/metrics"
    assert TRITON.serves == frozenset({"/infer"})
    assert TRITON.target("/infer", "scorer") == "/v2/models/scorer/infer"
    assert TRITON.health_path.replace("{model}", "scorer") == "/v2/models/scorer/ready"
    assert TRITON.key_headers("K") == {"x-sie-worker-key": "K"} and TRITON.key_headers(None) == {}
    assert TRITON.codec is not None and isinstance(TRITON.codec(TEXT), TritonCodec)


@pytest.mark.parametrize("on_gpu", [True, False])
def test_it_sleeps_by_unloading_the_model_through_the_repository_api(on_gpu):
    sleep = TRITON.sleep(on_gpu)
    assert sleep.release is MemoryRelease.CALL and sleep.why
    assert sleep.release_call is not None and sleep.resume_call is not None
    assert sleep.release_call.path.replace("{model}", "scorer") == "/v2/repository/models/scorer/unload"
    assert sleep.resume_call.path.replace("{model}", "scorer") == "/v2/repository/models/scorer/load"


def test_the_codec_asks_for_the_first_output_and_label_only():
    translate = TritonCodec(
        "m",
        [FieldSpec(name="t", type="string")],
        [FieldSpec(name="a", type="float32"), FieldSpec(name="b", type="int32")],
    )
    assert [f.name for f in translate.outputs] == ["a"]
