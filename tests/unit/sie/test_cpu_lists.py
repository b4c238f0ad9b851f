"""CPU lists (sie.cpu_lists): taskset's syntax read and written back, and the node host's TIER=CPUS list;
every malformed item refused with a message that names it. Property tests for the parsers (outside input:
flags and the cluster file)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from sie.cpu_lists import MAX_CPU, format_cpu_list, parse_cpu_list, parse_tier_cpus


@pytest.mark.parametrize(
    ("text", "cpus"),
    [
        ("0", {0}),
        ("0-1", {0, 1}),
        ("0,2", {0, 2}),
        (" 3 , 0-1 ", {0, 1, 3}),
        ("0-3,8-11", {0, 1, 2, 3, 8, 9, 10, 11}),
        ("2-2", {2}),
        ("1,1,0-1", {0, 1}),
    ],
)
def test_cpu_lists_parse(text, cpus):
    assert parse_cpu_list(text) == frozenset(cpus)


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("", "empty item"),
        ("0,", "empty item"),
        ("a", "not a CPU number"),
        ("-1", "not a CPU number"),
        ("3-1", "runs backwards"),
        ("0-", "not a CPU number"),
        ("1.5", "not a CPU number"),
        ("\u00b2", "not a CPU number"),  # a digit to str.isdigit(), not to int()
        (str(MAX_CPU + 1), "above"),
    ],
)
def test_bad_cpu_lists_are_refused_naming_the_item(text, match):
    with pytest.raises(ValueError, match=match):
        parse_cpu_list(text)


@pytest.mark.parametrize(
    ("cpus", "text"),
    [({0}, "0"), ({0, 1}, "0-1"), ({0, 2}, "0,2"), ({0, 1, 2, 5, 7, 8}, "0-2,5,7-8"), (set(), "")],
)
def test_cpu_lists_format(cpus, text):
    assert format_cpu_list(cpus) == text


@pytest.mark.parametrize(
    ("text", "tiers"),
    [
        ("", {}),
        ("gold=0", {"gold": {0}}),
        ("gold=0-1", {"gold": {0, 1}}),
        ("gold=0,2", {"gold": {0, 2}}),  # an item without TIER= continues the tier before it
        ("gold=0-1,4;silver=2", {"gold": {0, 1, 4}, "silver": {2}}),
        ("gold=0,silver=2-3", {"gold": {0}, "silver": {2, 3}}),
        (" gold = 1 ", {"gold": {1}}),
    ],
)
def test_tier_cpus_parse(text, tiers):
    assert parse_tier_cpus(text) == {k: frozenset(v) for k, v in tiers.items()}


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("0", "names no tier"),
        ("gold", "names no tier"),
        ("gold=", "has no CPUs"),
        ("=0", "not a tier name"),
        ("gold=0;gold=1", "given twice"),
        ("gold=x", "not a CPU number"),
        ("gold=2-1", "runs backwards"),
    ],
)
def test_bad_tier_cpus_are_refused_naming_the_item(text, match):
    with pytest.raises(ValueError, match=match):
        parse_tier_cpus(text)


@given(st.sets(st.integers(0, 300), min_size=1))
def test_a_formatted_list_reads_back(cpus):
    assert parse_cpu_list(format_cpu_list(cpus)) == frozenset(cpus)


@given(st.text(max_size=40))
def test_any_text_parses_or_raises_value_error(text):
    for parse in (parse_cpu_list, parse_tier_cpus):
        try:
            parse(text)
        except ValueError:
            pass
