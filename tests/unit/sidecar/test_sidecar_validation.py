"""input_schema checks: each FieldSpec type and constraint, accepted and refused, with the reason; and the
generation endpoints' sampling parameters, held to the same ranges as the worker holds them."""

import dataclasses
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from node_host.backends.protocol import BadRequest
from node_host.backends.runtime.bodies import TEMPERATURE_MAX, parse_chat, parse_completion, parse_generate
from sidecar.validation import TEMPERATURE_MAX as SIDECAR_TEMPERATURE_MAX
from sidecar.validation import Violation, check_body, check_document, compile_schema, sampling_problem
from sie.spec import IOSchema


def schema(*fields, allow_extra=True):
    return compile_schema(IOSchema.model_validate({"fields": list(fields), "allow_extra_fields": allow_extra}))


TEXT = {"name": "text", "type": "string", "max_length": 5, "min_length": 1}
I32 = {"name": "n", "type": "int32"}
I64_RANGE = {"name": "n", "type": "int64", "range": [0, 10]}
F32 = {"name": "x", "type": "float32", "range": [0.0, 1.0]}
F64 = {"name": "x", "type": "float64"}
FLAG = {"name": "b", "type": "bool"}
ITEMS = {"name": "a", "type": "array", "max_length": 2, "min_length": 1}
OBJ = {"name": "o", "type": "object"}
CHOICE = {"name": "c", "type": "string", "enum": ["x", "y"]}
NUM_CHOICE = {"name": "k", "type": "int32", "enum": [1, 2]}
OPTIONAL = {"name": "t", "type": "string", "required": False}


CASES = [
    # (field spec, body, None when accepted or (field, words the reason must contain))
    (TEXT, {"text": "abc"}, None),
    (TEXT, {"text": "abcdef"}, ("text", "max_length 5")),
    (TEXT, {"text": ""}, ("text", "min_length 1")),
    (TEXT, {"text": 3}, ("text", "must be a string")),
    (TEXT, {}, ("text", "required")),
    (TEXT, {"text": None}, ("text", "required")),
    (TEXT, {"text": "héllo"}, None),  # five characters, more than five bytes
    (I32, {"n": 7}, None),
    (I32, {"n": 2**31}, ("n", "outside the allowed range")),
    (I32, {"n": -(2**31)}, None),
    (I32, {"n": 1.0}, ("n", "must be an integer")),
    (I32, {"n": True}, ("n", "got a boolean")),
    (I32, {"n": "7"}, ("n", "got a string")),
    (I64_RANGE, {"n": 10}, None),
    (I64_RANGE, {"n": 11}, ("n", "[0, 10]")),
    (I64_RANGE, {"n": -1}, ("n", "outside")),
    (F32, {"x": 0.5}, None),
    (F32, {"x": 1}, None),  # an integer is a number
    (F32, {"x": 1.5}, ("x", "outside the allowed range [0, 1]")),
    (F32, {"x": False}, ("x", "got a boolean")),
    (F64, {"x": 1e300}, None),
    (F64, {"x": float("nan")}, ("x", "finite")),
    (F64, {"x": float("inf")}, ("x", "finite")),
    ({"name": "x", "type": "float32"}, {"x": 1e39}, ("x", "outside")),
    (FLAG, {"b": False}, None),
    (FLAG, {"b": 0}, ("b", "true or false")),
    (ITEMS, {"a": [1]}, None),
    (ITEMS, {"a": [1, 2, 3]}, ("a", "3 items, more than max_length 2")),
    (ITEMS, {"a": []}, ("a", "fewer than min_length 1")),
    (ITEMS, {"a": "ab"}, ("a", "must be an array")),
    (OBJ, {"o": {"k": 1}}, None),
    (OBJ, {"o": [1]}, ("o", "must be an object")),
    (CHOICE, {"c": "y"}, None),
    (CHOICE, {"c": "z"}, ("c", 'not one of the allowed values: "x", "y"')),
    (NUM_CHOICE, {"k": 2}, None),
    (NUM_CHOICE, {"k": 3}, ("k", "not one of")),
    (NUM_CHOICE, {"k": True}, ("k", "got a boolean")),
    (OPTIONAL, {}, None),
    (OPTIONAL, {"t": None}, None),
    (OPTIONAL, {"t": 1}, ("t", "must be a string")),
]


@pytest.mark.parametrize("field, body, expected", CASES, ids=[f"{c[0]['name']}:{json.dumps(c[1])[:30]}" for c in CASES])
def test_field_rules(field, body, expected):
    violation = check_document(schema(field), body)
    if expected is None:
        assert violation is None
    else:
        assert violation is not None, f"{body} should be refused"
        assert violation.field == expected[0]
        assert expected[1] in violation.reason


BODIES = [
    # (raw body, expected field, words in the reason)
    (b"", "", "empty"),
    (None, "", "empty"),
    (b"{not json", "", "not valid JSON"),
    (b"[1, 2]", "", "must be a JSON object, got an array"),
    (b'"text"', "", "got a string"),
    (b"\xff\xfe", "", "not valid UTF-8"),
]


@pytest.mark.parametrize("raw, field, words", BODIES)
def test_bodies_that_are_not_json_objects(raw, field, words):
    violation = check_body(schema(TEXT), raw)
    assert violation == Violation(field, violation.reason) and words in violation.reason


def test_valid_body_bytes_pass():
    assert check_body(schema(TEXT, I32), b'{"text": "ab", "n": 3, "other": 1}') is None


@pytest.mark.parametrize("allow_extra, expected", [(True, None), (False, "extra")])
def test_extra_fields(allow_extra, expected):
    violation = check_document(schema(TEXT, allow_extra=allow_extra), {"text": "a", "extra": 1})
    assert (violation.field if violation else None) == expected
    if violation:
        assert "accepts only: text" in violation.reason


def test_first_declared_field_is_reported_first():
    violation = check_document(schema(TEXT, I32), {"text": 1, "n": "x"})
    assert violation.field == "text"


@pytest.mark.parametrize("io_schema", [None, IOSchema(fields=[])])
def test_nothing_to_check_compiles_to_none(io_schema):
    # None lets the proxy skip parsing bodies altogether.
    assert compile_schema(io_schema) is None


def test_no_fields_but_no_extras_still_checks():
    compiled = compile_schema(IOSchema(fields=[], allow_extra_fields=False))
    assert check_document(compiled, {}) is None
    assert check_document(compiled, {"a": 1}).field == "a"


NUMERIC_FIELDS = [
    I32,
    I64_RANGE,
    F32,
    F64,
    NUM_CHOICE,
    {"name": "n", "type": "int64"},
    {"name": "x", "type": "float64", "range": [-1.5, 2]},
    {"name": "x", "type": "float32"},
]
AWKWARD = [0, 1, -1, 10, 11, 2**31 - 1, 2**31, -(2**31) - 1, 2**63 - 1, -(2**63), 0.0, -0.0, 0.5, 1.0, 1.5, 2.0]
AWKWARD += [2.5, 1e39, -1e39, 1.7e308, -1.7e308, float("nan"), float("inf"), float("-inf"), True, False, "1", [1]]


@pytest.mark.parametrize("spec", NUMERIC_FIELDS, ids=lambda s: f"{s['type']}-{s.get('range')}-{s.get('enum')}")
def test_the_one_comparison_shortcut_decides_every_number_as_the_full_check_does(spec):
    """Numbers without an enum are accepted by a type and range comparison before the full check; for
    every awkward value (bounds, NaN, infinities, bools, 1.0 for an integer) the answer is the full
    check's, refusals included."""
    fast = schema(spec)
    assert fast is not None
    full = type(fast)(
        tuple(dataclasses.replace(field, plain=()) for field in fast.fields), fast.names, fast.allow_extra_fields
    )
    if spec.get("enum") is None:
        assert fast.fields[0].plain, "a number field without an enum takes the shortcut"
    for value in AWKWARD:
        body = {spec["name"]: value}
        assert check_document(fast, body) == check_document(full, body), value


# ---- sampling parameters: the sidecar refuses what the worker would, naming the field -----------------

GREEDY = "; for greedy decoding send temperature 0"


@pytest.mark.parametrize(
    "path, doc, expected",
    [
        # top_p 0 keeps no token (torch.multinomial then failed the worker's whole batch)
        ("/generate", {"sampling_params": {"top_p": 0}}, ("sampling_params.top_p", "0 is outside (0, 1]" + GREEDY)),
        ("/generate", {"sampling_params": {"top_p": 0.0, "temperature": 1}}, ("sampling_params.top_p", "outside")),
        ("/v1/chat/completions", {"top_p": 0}, ("top_p", "outside (0, 1]")),
        ("/v1/completions", {"top_p": 1.5}, ("top_p", "1.5 is outside (0, 1]")),
        ("/v1/completions", {"top_p": "0.5"}, ("top_p", "must be a number, got a string")),
        ("/v1/completions", {"top_p": True}, ("top_p", "must be a number")),
        (
            "/generate",
            {"sampling_params": {"temperature": -0.5}},
            ("sampling_params.temperature", "-0.5 is outside [0, 100]"),
        ),
        ("/v1/chat/completions", {"temperature": 101}, ("temperature", "outside [0, 100]")),
        ("/v1/chat/completions", {"temperature": float("nan")}, ("temperature", "outside")),
        ("/v1/chat/completions", {"temperature": float("inf")}, ("temperature", "outside")),
        # SGLang's /generate takes one sampling_params per prompt: each is held to the ranges
        ("/generate", {"sampling_params": [{"top_p": 0.5}, {"top_p": 0}]}, ("sampling_params[1].top_p", "outside")),
        # accepted: near-zero temperatures are greedy (vLLM: below 1e-5), the bounds themselves, absence
        ("/generate", {"sampling_params": {"temperature": 1e-40, "top_p": 1e-9}}, None),
        ("/v1/chat/completions", {"temperature": 0, "top_p": 1}, None),
        ("/v1/chat/completions", {"temperature": 100.0, "top_p": None}, None),
        ("/generate", {"sampling_params": None}, None),
        # where the endpoint does not read them, they are not its sampling parameters
        ("/generate", {"top_p": 0}, None),
        ("/v1/chat/completions", {"sampling_params": {"top_p": 0}}, None),
        ("/infer", {"top_p": 0, "temperature": -1}, None),  # a scorer's fields may have any name
    ],
)
def test_sampling_parameters(path, doc, expected):
    problem = sampling_problem(path, doc)
    if expected is None:
        assert problem is None
    else:
        assert problem is not None and problem.field == expected[0] and expected[1] in problem.reason, problem


VALUES = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-3, 200),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([0, 0.0, -0.0, 1e-40, 1e-5, 1, 1.0, 1.0000001, 100, 100.0, 100.00001, 5e-324]),
    st.text(max_size=3),
)


@settings(max_examples=400, deadline=None)
@given(temperature=VALUES, top_p=VALUES)
def test_the_sidecar_and_the_worker_agree_on_every_temperature_and_top_p(temperature, top_p):
    """The sidecar is the first boundary and the worker checks again; neither may pass what the other
    refuses (a value only the worker refused cost a slot; one only the sidecar refused was never tested)."""
    assert TEMPERATURE_MAX == SIDECAR_TEMPERATURE_MAX
    values = {"temperature": temperature, "top_p": top_p}
    cases = [
        ("/generate", parse_generate, {"text": "x", "sampling_params": values}),
        ("/v1/chat/completions", parse_chat, {"messages": [{"role": "user", "content": "x"}], **values}),
        ("/v1/completions", parse_completion, {"prompt": "x", **values}),
    ]
    for path, parse, doc in cases:
        try:
            parse(doc, 0.0)
            worker_refused = False
        except BadRequest:
            worker_refused = True
        assert (sampling_problem(path, doc) is not None) == worker_refused, (path, doc)
