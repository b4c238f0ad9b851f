"""sie.strict_json and sie.strict_yaml: what untrusted JSON and YAML may be, and how each refusal reads."""

from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sie import strict_json, strict_yaml
from sie.errors import InputError


@pytest.mark.parametrize(
    "text, value",
    [
        ('{"a": [1, 2.5, "x", null, true]}', {"a": [1, 2.5, "x", None, True]}),
        ("\ufeff[1]", [1]),
        ('"\\ud83d\\ude00"', "\U0001f600"),  # a surrogate pair is a character
        (str(2**63 - 1), 2**63 - 1),
        (str(-(2**63)), -(2**63)),
    ],
)
def test_plain_json_parses_as_json_does(text, value):
    assert strict_json.loads(text) == value


def test_nesting_up_to_the_limit_is_fine():
    doc = strict_json.loads("[" * 64 + "]" * 64)
    for _ in range(63):
        doc = doc[0]
    assert doc == []


@pytest.mark.parametrize(
    "data, says",
    [
        (b"\xff", "not valid UTF-8"),
        (b'"\xed\xa0\x80"', "not valid UTF-8"),  # a surrogate encoded as UTF-8 bytes
        (b'{"t": "\\ud800"}', "lone UTF-16 surrogate"),
        (b'{"\\udfff": 1}', "lone UTF-16 surrogate"),  # in a key too
        (b"[" * 65 + b"]" * 65, "deeper than 64"),
        (b"[" * 5000 + b"]" * 5000, "deeper than 64"),
        (str(2**63).encode(), "64 bits"),
        (b"1" * 30, "more digits"),
        (b"1e999", "overflows"),
        (b"NaN", "not JSON"),
        (b"[-Infinity]", "not JSON"),
        (b'{"a": 1, "a": 2}', "appears twice"),
        (b'{"a": 1, "a": "\\u003a"}', "appears twice"),  # an escaped colon makes up for the dropped key's
        (b"{", "not valid JSON"),
    ],
)
def test_what_is_not_plain_json_is_an_input_error_saying_why(data, says):
    with pytest.raises(InputError) as err:
        strict_json.loads(data)
    assert err.value.kind == "invalid_json" and err.value.status == 400
    assert says in str(err.value)


# The fast path (orjson) must give exactly the strict path's answer: the same document, of the same types
# (1, 1.0 and True are equal in Python, so documents compare by repr), or the same refusal.
def _answer(parse, data):
    try:
        return "ok", repr(parse(data))
    except InputError as exc:
        return "refused", exc.kind, str(exc)


def _strict(data):
    return strict_json._strict_loads(data, strict_json.MAX_DEPTH, "the body")


def _assert_same(data):
    assert _answer(strict_json.loads, data) == _answer(_strict, data), data


_EDGES = [2**63 - 1, -(2**63), 2**63, -(2**63) - 1, 2**64 - 1, 2**64, 10**18, 10**19, 0, -0]
SCALARS = (
    st.none()
    | st.booleans()
    | st.integers()
    | st.sampled_from(_EDGES)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=12)
    | st.sampled_from(["a:b", '"', "\\", "\ud83d\ude00", "\x00", "{}", "[:]"])
)
DOCS = st.recursive(
    SCALARS,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4),
    max_leaves=25,
)
FAST = settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@FAST
@given(DOCS, st.booleans())
def test_the_fast_path_reads_json_as_the_strict_path_does(doc, ascii_only):
    text = json.dumps(doc, ensure_ascii=ascii_only)
    _assert_same(text)
    _assert_same(text.encode("utf-8", "surrogatepass"))


@FAST
@given(
    DOCS,
    st.integers(min_value=0, max_value=10_000),
    st.sampled_from(list(':,"{}[]\\ 0eE.-9\ufeff') + ["\\ud800", "\\u003a", "NaN", "1e999"]),
)
def test_the_fast_path_refuses_or_reads_broken_json_as_the_strict_path_does(doc, at, insert):
    text = json.dumps(doc)
    at %= len(text) + 1
    _assert_same((text[:at] + insert + text[at:]).encode("utf-8", "surrogatepass"))
    _assert_same(text[:at] + text[at + 1 :])


@FAST
@given(st.binary(max_size=40) | st.text(max_size=40))
def test_the_fast_path_answers_arbitrary_bytes_as_the_strict_path_does(data):
    _assert_same(data)


@FAST
@given(
    st.dictionaries(
        st.text(max_size=4), st.none() | st.integers(-(2**63), 2**63 - 1) | st.text(max_size=6), min_size=1, max_size=4
    ),
    st.data(),
)
def test_a_duplicate_key_is_refused_on_either_path(doc, data):
    # Built by hand: json.dumps cannot write one. Nested too, and beside keys with colons in them.
    key = data.draw(st.sampled_from(sorted(doc)))
    pairs = [f"{json.dumps(k)}: {json.dumps(v)}" for k, v in doc.items()] + [f"{json.dumps(key)}: 0"]
    body = "{" + ", ".join(pairs) + "}"
    for text in (body, '{"outer": ' + body + ', "a:b": "c:d"}', "[" + body + "]"):
        with pytest.raises(InputError, match="appears twice"):
            strict_json.loads(text.encode("utf-8", "surrogatepass"))
        _assert_same(text)


def test_the_fast_path_takes_the_usual_bodies(monkeypatch):
    # A scorer's request and a worker's batched call parse without the strict path; a body it must not
    # take (a long integer) goes there.
    calls = []
    monkeypatch.setattr(strict_json, "_strict_loads", lambda *a: calls.append(a) or "strict")
    assert strict_json.loads(b'{"amount": 12.5, "card_present": true}') == {"amount": 12.5, "card_present": True}
    assert strict_json.loads(b'{"instances": [{"a": 1}, {"a": 2}]}') == {"instances": [{"a": 1}, {"a": 2}]}
    assert calls == []
    assert strict_json.loads(str(2**63).encode()) == "strict"


def test_size_is_checked_before_parsing_and_objects_are_asked_for_by_name():
    with pytest.raises(InputError) as err:
        strict_json.loads(b"[" + b"1," * 100 + b"1]", max_bytes=50)
    assert err.value.kind == "body_too_large" and err.value.status == 413
    with pytest.raises(InputError, match="the record must be a JSON object, got list"):
        strict_json.loads_object("[]", what="the record")


@pytest.mark.parametrize(
    "text",
    [
        "a: &x 1\nb: *x\n",
        "base: &b {x: 1}\nmore:\n  <<: *b\n",
        "- &a [1]\n",
    ],
)
def test_yaml_anchors_and_aliases_are_refused_before_expansion(text):
    with pytest.raises(InputError) as err:
        strict_yaml.load(text)
    assert err.value.kind == "invalid_yaml" and "anchors and aliases" in str(err.value)


def test_yaml_is_bounded_in_size_depth_and_document_count():
    with pytest.raises(InputError, match="more than the 10 allowed"):
        strict_yaml.load("a: 1234567890", max_bytes=10)
    with pytest.raises(InputError, match="nested deeper"):
        strict_yaml.load("[" * 70 + "]" * 70)
    with pytest.raises(InputError, match="holds 2 YAML documents"):
        strict_yaml.load("a: 1\n---\nb: 2\n")
    assert strict_yaml.load_all("a: 1\n---\nb: 2\n") == [{"a": 1}, {"b": 2}]
    assert strict_yaml.load("") is None


def test_yaml_takes_safe_types_only():
    with pytest.raises(InputError, match="not valid YAML"):
        strict_yaml.load("!!python/object/apply:os.system ['true']")
