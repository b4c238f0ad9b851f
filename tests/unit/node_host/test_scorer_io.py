"""The sklearn scorer's conversions: typed rows to features, scores to typed rows."""

from __future__ import annotations

import math

import pytest

from node_host.backends.protocol import BadRequest
from node_host.backends.sklearn_engine import scorer_io
from sie.spec import FieldSpec

TEXT = [FieldSpec(name="text", type="string")]
NUMS = [
    FieldSpec(name="age", type="int32"),
    FieldSpec(name="note", type="string", required=False),
    FieldSpec(name="amount", type="float64"),
    FieldSpec(name="vip", type="bool", required=False),
]


@pytest.mark.parametrize(
    "rows, fields, expect",
    [
        ([{"text": "a"}, {"text": "b", "other": 1}], TEXT, ["a", "b"]),
        (
            [{"age": 3, "amount": 1.5, "vip": True, "note": "x"}],
            NUMS,
            [[3.0, 1.5, 1.0]],
        ),  # schema order, strings skipped
    ],
)
def test_features(rows, fields, expect):
    assert scorer_io.features(rows, fields) == expect


def test_optional_numeric_absent_is_nan():
    (row,) = scorer_io.features([{"age": 1, "amount": 2}], NUMS)
    assert row[:2] == [1.0, 2.0] and math.isnan(row[2])


@pytest.mark.parametrize(
    "rows, fields, needle",
    [
        ([{"text": 3}], TEXT, "instances[0].text: expected a string, got int"),
        ([{"text": "a"}, {}], TEXT, "instances[1].text: expected a string, got nothing"),
        ([{"amount": 1}], NUMS, "instances[0].age: required"),
        ([{"age": "old", "amount": 1}], NUMS, "instances[0].age: expected a number, got str"),
        ([{"a": "x"}], [FieldSpec(name="a", type="string"), FieldSpec(name="b", type="string")], "no numeric field"),
    ],
)
def test_feature_errors_name_row_and_field(rows, fields, needle):
    with pytest.raises(BadRequest) as err:
        scorer_io.features(rows, fields)
    assert needle in str(err.value)


@pytest.mark.parametrize(
    "value, field, expect",
    [
        (0.25, FieldSpec(name="s", type="float32", range=(0.0, 1.0)), 0.25),
        (1.7, FieldSpec(name="s", type="float32", range=(0.0, 1.0)), 1.0),
        (-3.0, FieldSpec(name="s", type="float64", range=(-1.0, 1.0)), -1.0),
        (0.6, FieldSpec(name="s", type="bool"), True),
        (0.4, FieldSpec(name="s", type="bool"), False),
        (2.6, FieldSpec(name="s", type="int32"), 3),
        (9.0, FieldSpec(name="s", type="int64", range=(0, 5)), 5),
        (1, FieldSpec(name="s", type="string"), "1"),
    ],
)
def test_convert(value, field, expect):
    got = scorer_io.convert(value, field)
    assert got == expect and type(got) is type(expect)


def test_outputs_first_field_is_score_and_label_is_class():
    fields = [
        FieldSpec(name="p", type="float32"),
        FieldSpec(name="label", type="string"),
        FieldSpec(name="x", type="int32"),
    ]
    assert scorer_io.outputs([0.9, 0.1], ["pos", "neg"], fields) == [
        {"p": 0.9, "label": "pos"},
        {"p": 0.1, "label": "neg"},
    ]


@pytest.mark.parametrize(
    "rows, fields, absent",
    [
        ([{"age": 1, "amount": 2, "vip": False}], NUMS, []),
        (
            [{"age": 1, "amount": 2}, {"age": 1, "amount": 2, "vip": True}, {"age": 3}],
            NUMS,
            ["instances[0].vip", "instances[2].vip"],
        ),
        ([{"age": 1, "amount": 2, "vip": None, "note": None}], NUMS, ["instances[0].vip"]),  # a string is no feature
        ([{}], TEXT, []),  # a text scorer has no missing values
    ],
)
def test_the_optional_numeric_fields_left_out_are_named(rows, fields, absent):
    assert scorer_io.absent_fields(rows, fields) == absent


def test_the_message_names_at_most_five_fields():
    message = scorer_io.absent_message([f"instances[{i}].b" for i in range(7)])
    assert message.startswith(
        "instances[0].b, instances[1].b, instances[2].b, instances[3].b, instances[4].b and 2 more"
    )
    assert "cannot score missing values" in message
