"""sie.strict_json and sie.strict_yaml: what untrusted JSON and YAML may be, and how each refusal reads."""

from __future__ import annotations

import pytest

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
        (b"{", "not valid JSON"),
    ],
)
def test_what_is_not_plain_json_is_an_input_error_saying_why(data, says):
    with pytest.raises(InputError) as err:
        strict_json.loads(data)
    assert err.value.kind == "invalid_json" and err.value.status == 400
    assert says in str(err.value)


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
