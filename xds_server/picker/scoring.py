"""Which instance a request with a prompt goes to (pure: values in, a choice out).

The prompt's text is cut into blocks of `block_chars` characters, each named by a hash chained over the
blocks before it (`prompt_blocks`), so two prompts share block names exactly as far as their text is
the same from the start: the system prompt, the few-shot examples, the earlier turns of a conversation.
For each instance `PrefixIndex` remembers, least recently used first and up to `capacity_blocks`, the
blocks of the requests it sent there: what that instance's prefix cache most likely holds (the picker
sees every request, so no engine has to report its cache).

`choose` applies, in order:

1. Only the instances SIE's control plane lets serve (in EDS, HEALTHY, not draining; `Candidate`), with
   the weights it pushes to Envoy (an instance it finds slow or saturated has a low one).
2. Bounded load: only those whose load is at most `balance` x their weighted share of the candidates'
   total load (+1, so an idle fleet admits everyone). Affinity never piles requests on a hot or slow
   instance (SGLang's router issues #14305, #27547: what users of cache-aware routers complain about).
3. The longest run of the prompt's leading blocks held; then the least (load + 1) / weight (when
   nothing is held, this is Envoy's weighted least request); then the fewest blocks remembered (a new
   prefix goes where the cache is emptiest, so prefixes spread over the instances); then the id.

In flight (the load) counts a request in full from its pick to the first byte of its answer (for a
stream, its first token: prefill, what the prefix cache shortens and TTFT is made of), and at
`decode_weight` from then to its end (decoding slows an engine's steps for everyone, but far less than
a prefill stalls them): the caller passes that sum per instance.
"""

from __future__ import annotations

import re
import zlib
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

BLOCK_CHARS = 256
MAX_PROMPT_CHARS = 65_536  # characters of prompt text hashed at most: a prefix past this is not worth a pick
SCAN_BYTES = 1 << 20  # bytes of body looked at, at most
MAX_FIELDS = 4096  # prompt keys taken at most (a conversation's first 4096 messages and parts)

# The scan is one pass over at most SCAN_BYTES, done by the regex engine: each search starts where the last
# match (or the string it read) ended and stops at the next match, so every byte is looked at a bounded
# number of times, however the body repeats a key's name. (It once took the earliest of four
# `body.find(key, i)`, each of which could run to the end of the body, and moved one byte past a name that
# was a value, not a key: a body of `"stop": ["text", "text", ...]` cost matches x size, 27 s for 512 KB,
# on the picker's only event loop.) MAX_FIELDS bounds the Python-level steps, one per key matched.
_FIELD = re.compile(rb'"(?:content|prompt|text|input)"[ \t\r\n]*:[ \t\r\n]*')
# A JSON string from its opening quote: a backslash takes the next byte with it, so a quote closes the
# string after an even number of backslashes. The unrolled loop has one way to match any text, so a string
# with no closing quote fails in one pass too.
_STRING = re.compile(rb'"([^"\\]*(?:\\.[^"\\]*)*)"', re.DOTALL)


@dataclass(frozen=True)
class Candidate:
    """An instance the control plane lets serve the model: its id, address and pushed weight."""

    instance_id: str
    address: str  # ip:port of its sidecar, as in EDS
    weight: int = 1


@dataclass(frozen=True)
class Choice:
    address: str
    instance_id: str
    held_blocks: int  # leading blocks of the prompt it holds
    blocks: int  # blocks of the prompt
    why: str


def prompt_text(body: bytes, limit: int = MAX_PROMPT_CHARS) -> bytes:
    """In document order, the string values of the keys that carry prompt text (chat messages' `content`
    and multimodal `text` parts, `prompt`, SGLang's `text`, embeddings' `input`), joined by newlines, up
    to `limit` bytes. Scanned, not parsed: escapes are kept as they are (the same prompt gives the same
    bytes), and a body that is not JSON gives what its quoted strings give, or nothing. Linear in the
    body's first SCAN_BYTES, whatever they hold."""
    body = body[:SCAN_BYTES]
    parts: list[bytes] = []
    have = 0
    i = 0
    for _ in range(MAX_FIELDS):
        if have >= limit:
            break
        field = _FIELD.search(body, i)
        if field is None:
            break
        j = field.end()
        if j < len(body) and body[j] == 0x22:  # a string value
            # Only its first `room` bytes can still count, so it is matched within them (and its closing
            # quote): the regex engine walks a string byte by byte, and a 1 MiB one took 40 ms.
            room = limit - have
            end = j + room + 2
            string = _STRING.match(body, j, end)
            if string is None:
                if end <= len(body):  # longer than the room: its first `room` bytes end the prompt
                    parts.append(body[j + 1 : j + 1 + room])
                break  # else never closed: nothing after it is a key
            parts.append(string.group(1))
            have += len(parts[-1]) + 1
            i = string.end()
        else:
            i = j  # an array or object (content parts): their "text" keys follow
    return b"\n".join(parts)[:limit]


def prompt_blocks(body: bytes, block_chars: int = BLOCK_CHARS) -> list[int]:
    """The chained hash of each whole block of the prompt's text."""
    text = prompt_text(body)
    out: list[int] = []
    previous = 0
    for start in range(0, len(text) - block_chars + 1, block_chars):
        previous = zlib.crc32(text[start : start + block_chars], previous)
        out.append(previous)
    return out


class PrefixIndex:
    """Per instance, the prompt blocks of the requests sent there, least recently used first."""

    def __init__(self, capacity_blocks: int):
        self.capacity_blocks = capacity_blocks
        self._held: dict[str, OrderedDict[int, None]] = {}

    def held(self, instance_id: str, blocks: Sequence[int]) -> int:
        cached = self._held.get(instance_id)
        if not cached:
            return 0
        n = 0
        for block in blocks:
            if block not in cached:
                break
            n += 1
        return n

    def size(self, instance_id: str) -> int:
        """Blocks remembered for the instance: how much of its cache the picker has filled."""
        return len(self._held.get(instance_id, ()))

    def record(self, instance_id: str, blocks: Sequence[int]) -> None:
        cached = self._held.setdefault(instance_id, OrderedDict())
        for block in blocks:
            cached[block] = None
            cached.move_to_end(block)
        while len(cached) > self.capacity_blocks:
            cached.popitem(last=False)

    def forget(self, keep: set[str]) -> None:
        """Drop what is remembered of instances no longer serving (gone, or restarted elsewhere)."""
        for gone in set(self._held) - keep:
            del self._held[gone]


def choose(
    candidates: Sequence[Candidate],
    blocks: Sequence[int],
    index: PrefixIndex,
    in_flight: dict[str, float],
    balance: float,
) -> Choice | None:
    """The instance for a prompt of these blocks (see the module docstring); None when no candidate."""
    if not candidates:
        return None
    loads = {c.instance_id: in_flight.get(c.instance_id, 0.0) for c in candidates}
    weights = {c.instance_id: max(1, c.weight) for c in candidates}
    total_load, total_weight = sum(loads.values()), sum(weights.values())

    def bound(c: Candidate) -> float:  # its weighted share of the load, times the balance factor, + 1
        return balance * total_load * weights[c.instance_id] / total_weight + 1

    def per_weight(c: Candidate) -> float:  # Envoy's weighted least request: (active + 1) / weight
        return (loads[c.instance_id] + 1) / weights[c.instance_id]

    allowed = [c for c in candidates if loads[c.instance_id] <= bound(c)] or candidates
    held = {c.instance_id: index.held(c.instance_id, blocks) for c in allowed}
    best = max(
        allowed,
        key=lambda c: (held[c.instance_id], -per_weight(c), -index.size(c.instance_id), c.instance_id),
    )
    skipped = len(candidates) - len(allowed)
    why = (
        f"holds {held[best.instance_id]} of {len(blocks)} prompt blocks"
        if held[best.instance_id]
        else "holds none of the prompt: the least in flight"
    )
    if skipped:
        why += f"; {skipped} over the bound ({balance:g} x their weighted share of the load)"
    return Choice(best.address, best.instance_id, held[best.instance_id], len(blocks), why)
