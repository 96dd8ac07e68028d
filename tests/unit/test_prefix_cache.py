"""The prefix cache over the page allocator: matches, locks, inserts and evictions under random request traffic.

A hypothesis state machine plays requests the way the schedulers do (match and lock a prefix, reserve the rest,
then insert and free at the end, or fail and free) while other reservations press on the pool. After every step:
each page is in exactly one place (free, a room's, or the cache's), the allocator's count of cached pages is the
tree's, and no page of a locked prefix is free or another room's.
"""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from fsm_pd.kvpool.pages import OutOfPages, PageAllocator, pages_for
from fsm_pd.kvpool.prefix_cache import PrefixCache

PAGE, POOL = 4, 16
# prompts share prefixes: a few "system prompts", then a random tail
SYSTEMS = [[1, 2, 3, 4, 5, 6, 7, 8, 9], [1, 2, 3, 4, 50, 51, 52, 53], [70, 71, 72, 73, 74, 75, 76, 77, 78, 79]]


class CacheMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.allocator = PageAllocator(POOL)
        self.cache = PrefixCache(self.allocator, PAGE)
        self.live: dict[int, tuple[list[int], object, list[int]]] = {}  # room -> (tokens, match, all pages)
        self.rooms = iter(range(1, 10**6))

    @rule(system=st.integers(0, len(SYSTEMS) - 1), tail=st.lists(st.integers(100, 104), max_size=9))
    def start(self, system, tail):
        tokens = SYSTEMS[system] + tail
        match = self.cache.match(tokens, max_pages=(len(tokens) - 1) // PAGE)
        self.cache.lock(match)
        room = next(self.rooms)
        try:
            new = self.allocator.reserve(room, pages_for(len(tokens), PAGE) - len(match.pages))
        except OutOfPages:
            self.cache.unlock(match)
            self.allocator.free(room)
            return
        self.live[room] = (tokens, match, list(match.pages) + new)

    @precondition(lambda self: self.live)
    @rule(data=st.data(), succeed=st.booleans())
    def end(self, data, succeed):
        room = data.draw(st.sampled_from(sorted(self.live)))
        tokens, match, pages = self.live.pop(room)
        if succeed:  # its full pages join the tree; the rest is freed with the room
            self.allocator.adopt(room, self.cache.insert(tokens, pages))
        self.cache.unlock(match)
        self.allocator.free(room)

    @rule(count=st.integers(1, 12))
    def pressure(self, count):
        """Another request wants pages: the cache gives way if it must."""
        room = next(self.rooms)
        try:
            self.allocator.reserve(room, count)
        except OutOfPages:
            return
        self.allocator.free(room)

    @invariant()
    def every_page_has_one_home(self):
        free = list(self.allocator._free)
        held = [p for pages in self.allocator._held.values() for p in pages]
        cached = sorted(self.cache.held_pages())
        everything = free + held + cached
        assert sorted(everything) == list(range(1, POOL)), "a page is lost or in two places"
        assert self.allocator.cached_pages == self.cache.pages == len(cached)

    @invariant()
    def locked_prefixes_stay_put(self):
        cached = self.cache.held_pages()
        free = set(self.allocator._free)
        for room, (_, match, _) in self.live.items():
            for page in match.pages:
                assert page in cached and page not in free, f"room {room}'s locked page {page} left the cache"

    @invariant()
    def free_pages_count_what_can_be_had(self):
        assert self.allocator.free_pages == len(self.allocator._free) + self.cache.reclaimable()


TestCacheMachine = CacheMachine.TestCase
TestCacheMachine.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)


def test_a_second_request_computes_only_what_the_first_did_not_leave():
    allocator = PageAllocator(16)
    cache = PrefixCache(allocator, PAGE)
    first = list(range(1, 11))  # 10 tokens: 2 full pages and a partial one
    pages = allocator.reserve(1, 3)
    allocator.adopt(1, cache.insert(first, pages))
    allocator.free(1)
    assert cache.pages == 2 and allocator.reserved_pages == 0 and allocator.free_pages == 15
    again = cache.match(first + [11, 12, 13])
    assert again.tokens == 8 and list(again.pages) == pages[:2]
    cache.record(again, 13)
    assert cache.match([1, 2, 3, 4, 9, 9, 9, 9]).tokens == 4  # a shared first page only
    assert (cache.hit_tokens, cache.looked_up_tokens) == (8, 13)


def test_eviction_takes_unlocked_leaves_least_recently_used_first():
    allocator = PageAllocator(6)  # 5 usable pages
    cache = PrefixCache(allocator, PAGE)
    old, new = [1] * 8, [2] * 8
    for room, tokens in ((1, old), (2, new)):
        allocator.adopt(room, cache.insert(tokens, allocator.reserve(room, 2)))
        allocator.free(room)
    held = cache.match(new)
    cache.lock(held)
    assert allocator.free_pages == 3  # one free, two of the old prefix's; the locked ones stay
    allocator.reserve(3, 3)
    assert cache.match(old).tokens == 0 and cache.match(new).tokens == 8 and cache.evicted_pages == 2
    with pytest.raises(OutOfPages):
        allocator.reserve(4, 1)
    cache.unlock(held)
    assert allocator.reserve(4, 1)  # now the cache gives way


def test_unlocking_more_than_locked_is_a_bug_that_raises():
    allocator = PageAllocator(8)
    cache = PrefixCache(allocator, PAGE)
    allocator.adopt(1, cache.insert([5] * 4, allocator.reserve(1, 1)))
    match = cache.match([5] * 5)
    cache.lock(match)
    cache.unlock(match)
    with pytest.raises(RuntimeError, match="unlocked more often"):
        cache.unlock(match)
