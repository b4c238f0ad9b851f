"""Incremental detokenization: text is released once final, stop strings cut it."""

from __future__ import annotations

import pytest

from node_host.backends.torch_engine.detokenize import TextTracker

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


def test_a_partial_character_at_the_end_is_flushed():
    tracker = TextTracker(decode)
    assert tracker.push(1) == "Hel"
    assert tracker.push(99) == ""
    assert tracker.flush() == "\ufffd"


def test_sentencepiece_style_leading_space_is_kept_between_tokens():
    # SentencePiece drops the word marker's space at the start of a text, so a token decoded alone
    # lacks the space it has after another token; the window's context token keeps it.
    pieces = {1: "\u2581Hello", 2: "\u2581world", 3: "!"}

    def sp_decode(ids: list[int]) -> str:
        return "".join(pieces[i] for i in ids).replace("\u2581", " ").removeprefix(" ")

    tracker = TextTracker(sp_decode)
    assert [tracker.push(t) for t in (1, 2, 3)] == ["Hello", " world", "!"]


def test_matches_one_full_decode_on_a_real_tokenizer(tiny_model_dir):
    transformers = pytest.importorskip("transformers")
    tokenizer = transformers.AutoTokenizer.from_pretrained(tiny_model_dir)
    text = "Héllo, wörld! Ünïcödé ✓ 你好 and plain words."
    ids = tokenizer.encode(text)
    tracker = TextTracker(lambda xs: tokenizer.decode(xs, skip_special_tokens=True))
    assert "".join(tracker.push(t) for t in ids) + tracker.flush() == text
