"""The prefix cache: a radix tree of token ids at page granularity over the paged KV pool (SGLang's radix cache).

Each node below the root is one full page of a token sequence: its key is that page's ``page_size`` token ids, and
its ``page`` holds their KV. A path from the root spells a prefix; a request whose prompt starts with it reuses those
pages and computes only the rest.

- ``match(tokens)`` finds the longest cached prefix in whole pages; ``lock`` / ``unlock`` count the requests using a
  path, so its pages are never evicted (or freed) while one does.
- ``insert(tokens, pages)`` adds the full pages of a finished request's sequence that the tree lacks and returns them:
  the caller moves them from the request's reservation to the cache (``PageAllocator.adopt``). Pages the tree already
  has, and a last partial page, stay the request's, and are freed with it.
- ``reclaim(n)`` evicts unlocked leaves, least recently used first, and gives their pages back to the allocator. The
  allocator calls it when a reservation finds too few free pages, so the cache gives way before any request is
  retracted; ``reclaimable()`` counts what it could give.

Owned by the model thread, like the pool and the allocator's reservations (``docs/threads.md``); no jax here, so the
simulation runs it too.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field

from fsm_pd.kvpool.pages import PageAllocator


@dataclass(eq=False, slots=True)
class _Node:
    key: tuple[int, ...]
    page: int
    parent: _Node | None
    children: dict[tuple[int, ...], _Node] = field(default_factory=dict)
    locks: int = 0  # requests using this node (every node on their matched path)
    used: int = 0  # logical clock of the last match or insert through it


@dataclass(frozen=True, slots=True)
class Match:
    """A cached prefix: ``pages`` hold its first ``tokens`` tokens (``len(pages) * page_size``)."""

    nodes: tuple[_Node, ...]
    pages: tuple[int, ...]
    tokens: int


NO_MATCH = Match((), (), 0)


class PrefixCache:
    def __init__(self, allocator: PageAllocator, page_size: int):
        self.allocator, self.page_size = allocator, page_size
        self._root = _Node((), -1, None)
        self._clock = itertools.count(1)
        self.pages = 0  # pages the tree holds
        self.locked = 0  # of those, pages on a path some request uses
        self.looked_up_tokens = 0  # prompt tokens looked up, and of those found: the hit ratio
        self.hit_tokens = 0
        self.evicted_pages = 0
        allocator.reclaimer = self

    # --- requests ---
    def match(self, tokens: Sequence[int], max_pages: int | None = None) -> Match:
        """The longest cached prefix of ``tokens`` in whole pages (at most ``max_pages``). A lookup only: a request
        that takes the prefix locks it and ``record``s it."""
        size, node, nodes = self.page_size, self._root, []
        limit = len(tokens) // size if max_pages is None else min(max_pages, len(tokens) // size)
        for index in range(limit):
            child = node.children.get(tuple(tokens[index * size:(index + 1) * size]))
            if child is None:
                break
            nodes.append(child)
            node = child
        return Match(tuple(nodes), tuple(n.page for n in nodes), len(nodes) * size) if nodes else NO_MATCH

    def record(self, match: Match, prompt_tokens: int) -> None:
        """A request of ``prompt_tokens`` took ``match``: counts the hit and marks its pages used now (LRU)."""
        now = next(self._clock)
        for node in match.nodes:
            node.used = now
        self.looked_up_tokens += prompt_tokens
        self.hit_tokens += match.tokens

    def lock(self, match: Match) -> None:
        for node in match.nodes:
            if node.locks == 0:
                self.locked += 1
            node.locks += 1

    def unlock(self, match: Match) -> None:
        for node in match.nodes:
            if node.locks <= 0:
                raise RuntimeError(f"page {node.page} is unlocked more often than it was locked")
            node.locks -= 1
            if node.locks == 0:
                self.locked -= 1

    def insert(self, tokens: Sequence[int], pages: Sequence[int]) -> list[int]:
        """Add the full pages of ``tokens`` (page ``i`` of ``pages`` holds tokens ``[i * page_size, ...)``) that the
        tree lacks; returns those pages, which the cache now owns (the caller adopts them from the request)."""
        size, node, adopted = self.page_size, self._root, []
        now = next(self._clock)
        for index in range(min(len(tokens) // size, len(pages))):
            key = tuple(tokens[index * size:(index + 1) * size])
            child = node.children.get(key)
            if child is None:
                child = node.children[key] = _Node(key, int(pages[index]), node)
                adopted.append(child.page)
                self.pages += 1
            child.used = now
            node = child
        return adopted

    # --- the allocator's reclaimer ---
    def reclaimable(self) -> int:
        """Pages eviction could free now: every page on no locked path (a locked node's ancestors are locked too)."""
        return self.pages - self.locked

    def reclaim(self, count: int) -> int:
        """Evict at least ``count`` pages if that many are unlocked: leaves first, least recently used first."""
        # a heap, not a sort per pop: a big reclaim from a big tree stays O(n log n) on the model thread
        leaves = [(n.used, n.page, n) for n in self._nodes() if not n.children and n.locks == 0]
        heapq.heapify(leaves)
        freed: list[int] = []
        while leaves and len(freed) < count:
            _, _, node = heapq.heappop(leaves)
            del node.parent.children[node.key]
            freed.append(node.page)
            parent = node.parent
            if parent is not self._root and not parent.children and parent.locks == 0:
                heapq.heappush(leaves, (parent.used, parent.page, parent))
        if freed:
            self.pages -= len(freed)
            self.evicted_pages += len(freed)
            self.allocator.release(freed)
        return len(freed)

    def clear(self) -> int:
        """Evict everything unlocked (``/flush_cache``); returns how many pages went back."""
        return self.reclaim(self.pages)

    def counters(self) -> dict:
        return {"cached_pages": self.pages, "cached_pages_locked": self.locked,
                "prefix_lookup_tokens": self.looked_up_tokens, "prefix_hit_tokens": self.hit_tokens,
                "prefix_evicted_pages": self.evicted_pages}

    def held_pages(self) -> set[int]:
        return {n.page for n in self._nodes()}

    def lock_counts(self) -> dict[int, int]:
        """Page -> how many requests lock it, for every locked page the tree holds (the simulation's check)."""
        return {n.page: n.locks for n in self._nodes() if n.locks}

    def _nodes(self):
        stack = list(self._root.children.values())
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())
