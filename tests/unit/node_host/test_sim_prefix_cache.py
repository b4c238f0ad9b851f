"""The sim backend's prefix cache (RadixAttention as a simulator needs it): hit, miss, partial hit and
LRU eviction in the cache itself and in the scheduler's timing and KV accounting; tokens from text."""

from __future__ import annotations

import pytest

from node_host.backends.protocol import GenerateRequest, SamplingParams
from node_host.backends.sim.core import SimCore, SimParams
from node_host.backends.sim.prefix_cache import PrefixCache, page_keys
from node_host.backends.sim.worker import prompt_token_ids

P = 4  # tokens per page in these tests


def ids(*words: str) -> list[int]:
    return prompt_token_ids(GenerateRequest(rid="t", text=" ".join(words), params=SamplingParams()))


def test_page_keys_chain_whole_pages_only():
    a = page_keys(list(range(10)), P)
    assert len(a) == 2, "10 tokens are two whole pages of 4; the partial third is not cached"
    b = page_keys(list(range(8)) + [99, 98], P)
    assert a == b, "the same first 8 tokens name the same pages, whatever follows"
    c = page_keys([0, 1, 2, 3, 9, 9, 9, 9], P)
    assert c[0] == a[0] and c[1] != a[1], "a page's key depends on everything before it"
    assert page_keys([4, 5, 6, 7], P) != (a[1],), "the same tokens after another prefix are another page"


def test_tokens_come_from_the_text_so_a_shared_prefix_is_a_shared_prefix_of_tokens():
    assert ids("you are a helpful assistant", "hi")[:5] == ids("you are a helpful assistant", "bye")[:5]
    chat = GenerateRequest(rid="t", messages=[{"role": "system", "content": "be brief"}], params=SamplingParams())
    other = GenerateRequest(rid="t", messages=[{"role": "user", "content": "be brief"}], params=SamplingParams())
    assert prompt_token_ids(chat) != prompt_token_ids(other), "the role marker is a token too"
    assert prompt_token_ids(chat) == prompt_token_ids(chat)


def test_hit_miss_and_partial_hit_in_the_cache():
    cache = PrefixCache(P)
    first = page_keys(list(range(16)), P)
    assert cache.match(first) == 0  # miss
    assert cache.insert(first) == 16 and cache.tokens == 16 and cache.locked_tokens == 16
    cache.unlock(first)
    assert cache.evictable == 16
    assert cache.match(first) == 4  # hit: every page
    partial = page_keys(list(range(8)) + [70, 71, 72, 73, 74, 75, 76, 77], P)
    assert cache.match(partial) == 2  # the shared 8 tokens
    assert cache.insert(partial) == 8, "only the two new pages are added"
    assert cache.tokens == 24


def test_eviction_takes_unlocked_leaves_least_recently_used_first():
    cache = PrefixCache(P)
    old, new = page_keys(list(range(8)), P), page_keys(list(range(100, 108)), P)
    cache.insert(old)
    cache.unlock(old)
    cache.insert(new)  # new stays locked: a running request uses it
    assert cache.evict(4) == 4 and cache.match(old) == 1, "the leaf of the old chain goes first, not its root"
    assert cache.evict(100) == 4 and cache.match(old) == 0
    assert cache.match(new) == 2 and cache.tokens == 8, "locked pages are never evicted"
    cache.unlock(new)
    cache.lock(new[:1])  # a request uses the first page only
    assert cache.evict(100) == 4 and cache.match(new) == 1


def core(**params) -> SimCore:
    return SimCore(
        SimParams(
            prefix_cache=True,
            page_size=P,
            prefill_ms_per_token=1.0,
            decode_base_ms=0.0,
            decode_ms_per_request=0.0,
            kv_tokens=64,
            admit_reserve_ratio=0.0,
            **params,
        )
    )


def run(sim: SimCore, prompt: list[int], new: int = 1, at: float = 0.0):
    keys = page_keys(prompt, P)
    sim.submit(len(prompt), new, at, keys)
    done = sim.advance(at + 1000.0)
    (result,) = done
    return result


def test_a_cached_prefix_is_not_prefilled_again():
    sim = core()
    prompt = list(range(24))
    cold = run(sim, prompt)
    warm = run(sim, prompt, at=2000.0)
    assert cold.ttft_s == pytest.approx(0.024), "24 prompt tokens at 1 ms each"
    # 20 tokens are 5 whole pages found cached; at least the last token is always computed: 4 of 24
    assert warm.ttft_s == pytest.approx(0.004)
    loads = sim.loads()
    assert loads.cache_hit_rate == pytest.approx(20 / 48)
    assert loads.used_tokens == 0, "cached pages nobody uses are free memory, not KV use"
    assert sim.cache.evictable == 24


def test_a_partial_hit_prefills_only_what_differs_and_a_miss_everything():
    sim = core()
    run(sim, list(range(16)))
    partial = run(sim, list(range(8)) + list(range(500, 508)), at=2000.0)
    miss = run(sim, list(range(900, 916)), at=4000.0)
    assert partial.ttft_s == pytest.approx(0.008)
    assert miss.ttft_s == pytest.approx(0.016)


def test_cached_pages_give_way_lru_when_requests_need_the_budget():
    sim = core()  # 64 KV tokens
    for n in range(3):  # three distinct 16-token prompts: 48 tokens cached
        run(sim, list(range(100 * n, 100 * n + 16)), at=2000.0 * n)
    assert sim.cache.tokens == 48
    big = run(sim, list(range(5000, 5040)), at=10_000.0)  # 40 + 1 tokens: needs pages evicted
    assert big.error is None and big.ttft_s == pytest.approx(0.040)
    assert sim.cache.tokens <= 64 and sim.cache.match(page_keys(list(range(200, 216)), P)) == 4
    assert sim.cache.match(page_keys(list(range(0, 16)), P)) == 0, "the least recently used went first"


def test_off_by_default_and_then_no_hit_rate():
    sim = SimCore(SimParams())
    keys = page_keys(list(range(32)), 16)
    sim.submit(32, 1, 0.0, keys)
    sim.advance(10.0)
    assert sim.loads().cache_hit_rate is None and sim.cache.tokens == 0
