"""The `sim` backend's prefix cache, modelled on SGLang's RadixAttention (pure: no clock, no I/O).

A prompt is a sequence of token ids; its KV cache is kept in pages of `page_size` tokens, and a page is
named by the chain of everything before it (`page_keys`: the key of page i hashes page i's tokens with
the key of page i - 1), so two prompts share the pages of their common prefix and nothing else, as the
nodes of SGLang's radix tree do. Only whole pages are cached.

Pages live in the engine's KV budget:

  * `match` finds how many leading pages of a prompt are cached; a request that runs `lock`s them (they
    cannot be evicted while it uses them: SGLang's reference counts), and `unlock`s them when it ends.
  * `insert` adds a prompt's pages once its prefill has computed them (locked by that request).
  * `evict` frees unlocked pages, least recently used first, and only leaves (a page no cached page
    extends), so the tree is never cut in the middle and what remains is still reachable.

`tokens` is everything cached; `locked_tokens` the part in use by running requests; the rest is
`evictable`: memory the engine may take back at once, which is why the simulator reports KV use
without it (as SGLang's token_usage does).
"""

from __future__ import annotations

import zlib
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["PrefixCache", "page_keys"]


def page_keys(token_ids: Sequence[int], page_size: int) -> tuple[int, ...]:
    """The chained key of each whole page of `token_ids` (a partial last page has none)."""
    keys: list[int] = []
    previous = 0
    for start in range(0, len(token_ids) - page_size + 1, page_size):
        page = ",".join(map(str, token_ids[start : start + page_size]))
        previous = zlib.crc32(f"{previous}:{page}".encode())  # stable across processes, unlike hash()
        keys.append(previous)
    return tuple(keys)


@dataclass
class _Page:
    parent: int | None
    children: int = 0  # cached pages that extend it
    refs: int = 0  # running requests that use it


class PrefixCache:
    def __init__(self, page_size: int = 16):
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        self.page_size = page_size
        self._pages: OrderedDict[int, _Page] = OrderedDict()  # least recently used first
        self._locked_pages = 0

    @property
    def tokens(self) -> int:
        return len(self._pages) * self.page_size

    @property
    def locked_tokens(self) -> int:
        return self._locked_pages * self.page_size

    @property
    def evictable(self) -> int:
        return self.tokens - self.locked_tokens

    def __contains__(self, key: int) -> bool:
        return key in self._pages

    def match(self, keys: Sequence[int]) -> int:
        """How many leading pages of `keys` are cached (a lookup: nothing changes)."""
        n = 0
        for key in keys:
            if key not in self._pages:
                break
            n += 1
        return n

    def lock(self, keys: Sequence[int]) -> None:
        """A running request uses these (cached) pages: they stay until `unlock`, and count as recent."""
        for key in keys:
            page = self._pages[key]
            if page.refs == 0:
                self._locked_pages += 1
            page.refs += 1
            self._pages.move_to_end(key)

    def unlock(self, keys: Sequence[int]) -> None:
        for key in keys:
            page = self._pages.get(key)
            if page is None or page.refs == 0:
                continue
            page.refs -= 1
            if page.refs == 0:
                self._locked_pages -= 1

    def insert(self, keys: Sequence[int]) -> int:
        """Cache the pages `keys` (a prefix chain) and lock them for the request that computed them;
        returns how many tokens were not cached before (pages another request added meanwhile are
        shared, not added twice)."""
        added = 0
        parent: int | None = None
        for key in keys:
            if key not in self._pages:
                self._pages[key] = _Page(parent)
                if parent is not None:
                    self._pages[parent].children += 1
                added += 1
            parent = key
        self.lock(keys)
        return added * self.page_size

    def evict(self, tokens: int) -> int:
        """Free at least `tokens` of unlocked pages (LRU leaves first, repeatedly); returns what was
        freed, which is less when not enough is evictable."""
        freed = 0
        while freed < tokens:
            victim = next((k for k, p in self._pages.items() if p.refs == 0 and p.children == 0), None)
            if victim is None:
                break
            page = self._pages.pop(victim)
            if page.parent is not None and page.parent in self._pages:
                self._pages[page.parent].children -= 1
            freed += self.page_size
        return freed
