"""Incremental detokenization: text is released once final, stop strings cut it."""

from __future__ import annotations

import pytest

from node_host.backends.detokenize import TextTracker

# A toy tokenizer: each token id is one piece of text; 99 decodes as a partial character.
PIECES = {1: "Hel", 2: "lo", 3: " wor", 4: "ld", 5: "\n", 6: "EN", 7: "D", 8: "é", 99: "\ufffd"}


def decode(ids: list[int]) -> str:
    text = "".join(PIECES[i] for i in ids)
    # 99 followed by 8 stands for the two bytes of one character: together they decode as "é".
    return text.replace("\ufffdé", "é")


@pytest.mark.parametrize(
    "tokens, stops, pieces, matched, rest",
    [
        ([1, 2, 3, 4], (), ["Hel", "lo", " wor", "ld"], None, ""),
        ([1, 5, 2], ("\n",), ["Hel", ""], "\n", None),  # stop string not returned, generation ends
        ([1, 6, 7], ("END",), ["Hel", "", ""], "END", None),  # "EN" held back until "D" proves the stop
        ([1, 6, 2], ("END",), ["Hel", "", "ENlo"], None, ""),  # "EN" released when it is not a stop
        ([1, 6], ("END",), ["Hel", ""], None, "EN"),  # flushed at the end
        ([1, 99, 8], (), ["Hel", "", "é"], None, ""),  # partial character held back
        ([3, 4], ("orl", "world"), [" ", ""], "world", None),  # "wor" held as a prefix; earliest stop wins
    ],
)
def test_text_tracker(tokens, stops, pieces, matched, rest):
    tracker = TextTracker(decode, stops)
    got = []
    for token in tokens:
        got.append(tracker.push(token))
        if tracker.matched:
            break
    assert got == pieces
    assert tracker.matched == matched
    if rest is not None:
        assert tracker.flush() == rest


def test_push_after_stop_is_an_error():
    tracker = TextTracker(decode, ("lo",))
    tracker.push(1)
    tracker.push(2)
    with pytest.raises(RuntimeError):
        tracker.push(3)
