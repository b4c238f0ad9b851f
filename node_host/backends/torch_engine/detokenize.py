"""Incremental detokenization with stop strings (pure: the tokenizer's decode is passed in).

Streaming wants each token's new text as soon as it is final. Two things make text not yet final:
an incomplete UTF-8 sequence (byte-level tokenizers decode a partial character as U+FFFD) and a suffix
that could still grow into a stop string (it must never be sent if it does). Both are held back until
the next token settles them. A stop string ends the generation; neither it nor anything after it is
returned, as in SGLang and OpenAI.

Cost per token is constant, not proportional to the length so far: only the tokens since the last
settled point are decoded, together with a few tokens before it (`prefix_offset` .. `read_offset`),
because some tokenizers (SentencePiece) decode a token differently at the start of a text than after
another token. The new text is what decoding the window adds to decoding its settled head (the same
scheme as vLLM's and Hugging Face's incremental detokenizers).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

_REPLACEMENT = "\ufffd"


def _held_suffix(text: str, stops: Sequence[str]) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of some stop string."""
    longest = 0
    for stop in stops:
        for size in range(min(len(stop) - 1, len(text)), longest, -1):
            if text.endswith(stop[:size]):
                longest = size
                break
    return longest


class TextTracker:
    """Follows one generation's tokens; `push` returns the text that became final."""

    def __init__(self, decode: Callable[[list[int]], str], stops: Sequence[str] = ()):
        self._decode = decode
        self._stops = tuple(stops)
        self.ids: list[int] = []
        self._prefix_offset = 0  # start of the decode window (context for the first unsettled token)
        self._read_offset = 0  # tokens before this are in _text
        self._text = ""  # settled text: no partial character at its end
        self._sent = 0  # characters of _text already returned
        self.matched: str | None = None  # the stop string that ended the generation
        self._cut = 0

    def _settle(self, force: bool) -> None:
        head = self._decode(self.ids[self._prefix_offset : self._read_offset])
        window = self._decode(self.ids[self._prefix_offset :])
        if len(window) > len(head) and (force or not window.endswith(_REPLACEMENT)):
            self._text += window[len(head) :]
            self._prefix_offset, self._read_offset = self._read_offset, len(self.ids)

    def push(self, token: int) -> str:
        if self.matched is not None:
            raise RuntimeError("push after a stop string matched")
        self.ids.append(token)
        self._settle(force=False)
        for stop in self._stops:
            # A stop may straddle what was sent and what is new, but never lies wholly in the sent part.
            at = self._text.find(stop, max(0, self._sent - len(stop) + 1))
            if at != -1 and (self.matched is None or at < self._cut):
                self.matched, self._cut = stop, at
        if self.matched is not None:
            new = self._text[self._sent : self._cut]
            self._sent = self._cut
            return new
        final = len(self._text) - _held_suffix(self._text, self._stops)
        if final <= self._sent:
            return ""
        new = self._text[self._sent : final]
        self._sent = final
        return new

    def flush(self) -> str:
        """At the end of a generation that no stop string ended: everything not yet returned, a
        trailing partial character included (as U+FFFD)."""
        if self.matched is not None:
            return ""
        self._settle(force=True)
        new = self._text[self._sent :]
        self._sent = len(self._text)
        return new
