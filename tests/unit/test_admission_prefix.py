"""Admission with a prefix cache counts free pages after locking the prefix it will use.

A matched prefix's pages are unlocked until the request takes them, so the cache counts them as pages it could
evict; counted before the lock, admission promised pages that the reservation then could not find: OutOfPages out
of the scheduler's step, with the prefix left locked for ever (the simulation's property suite found it).
"""

from __future__ import annotations

from collections import deque
from types import SimpleNamespace

from fsm_pd.kvpool.pages import PageAllocator
from fsm_pd.kvpool.prefix_cache import NO_MATCH, PrefixCache
from fsm_pd.scheduling.page_admission import admit_waiting, take_prefill_batch

PAGE = 4


def _request(key: int, tokens: list[int]) -> SimpleNamespace:
    return SimpleNamespace(key=key, prompt_len=len(tokens), request=SimpleNamespace(input_ids=tokens,
                           return_logprob=False), pages=[], prefix=NO_MATCH, prefilled=0, meta={}, queued_at=0.0)


def _pool_with_only_a_cached_prefix() -> tuple[PageAllocator, PrefixCache, list[int]]:
    """Seven usable pages: four hold a cached 16-token prompt (unlocked), three a live room's; none is free."""
    allocator = PageAllocator(8)
    cache = PrefixCache(allocator, PAGE)
    prompt = list(range(16))
    allocator.adopt(1, cache.insert(prompt, allocator.reserve(1, 4)))
    allocator.free(1)
    allocator.reserve(2, 3)
    return allocator, cache, prompt


def test_a_prefill_prompt_whose_only_room_is_its_own_prefix_waits():
    allocator, cache, prompt = _pool_with_only_a_cached_prefix()
    queue = deque([_request(3, [*prompt, 99, 98, 97, 96])])  # its first four pages are cached; it needs one more
    assert take_prefill_batch(queue, allocator, PAGE, max_batch=4, max_tokens=512, headroom=0, drop=lambda s: False,
                              cache=cache) == []
    assert len(queue) == 1 and cache.locked == 0  # it waits, and locks nothing meanwhile
    allocator.free(2)
    assert [s.key for s in take_prefill_batch(queue, allocator, PAGE, max_batch=4, max_tokens=512, headroom=0,
                                              drop=lambda s: False, cache=cache)] == [3]
    assert cache.locked == 4


def test_a_decode_room_whose_only_room_is_its_own_prefix_waits():
    allocator, cache, prompt = _pool_with_only_a_cached_prefix()
    granted = []
    queue = deque([_request(3, [*prompt, 99])])
    assert admit_waiting(queue, allocator, PAGE, headroom=0, room_for=4, gone=lambda e: False,
                         grant=lambda *g: granted.append(g), cache=cache) == 0
    assert len(queue) == 1 and cache.locked == 0 and granted == []
    allocator.free(2)
    assert admit_waiting(queue, allocator, PAGE, headroom=0, room_for=4, gone=lambda e: False,
                         grant=lambda *g: granted.append(g), cache=cache) == 1
    assert granted[0][2] == 4 and cache.locked == 4
