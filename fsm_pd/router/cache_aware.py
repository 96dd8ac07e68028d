"""Cache-aware selection (``--policy cache_aware``, sglang-router's): send a request where its longest prefix went.

The router cannot see a node's prefix cache, so it keeps an approximate one per worker: a tree of the requests it
sent there, in chunks of ``CHUNK`` characters of each request's routing key (``routing_key``: the prompt's text, or
its token ids). For a request:

1. when the fleet is imbalanced (the busiest worker has more than ``balance_abs_threshold`` requests in flight over
   the idlest, and more than ``balance_rel_threshold`` times as many), the least busy worker takes it;
2. else the worker whose record shares the longest prefix with it takes it, if that prefix is more than
   ``cache_threshold`` of the key;
3. else the worker with the smallest record (the most cache room to fill).

The chosen worker's record then holds the key. A record keeps at most ``max_tree_chars`` characters; beyond that its
least recently used leaves go, as a node's cache would evict them, down to ``EVICT_TO`` of the size. The defaults
are sglang-router's.
"""

from __future__ import annotations

import heapq
import itertools
import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

CHUNK = 16  # characters per tree node: a prefix is matched to within this many
EVICT_TO = 0.9  # a record over its size evicts down to this share of it


@dataclass(frozen=True, slots=True)
class CacheAwareSettings:
    cache_threshold: float = 0.3
    balance_abs_threshold: int = 64
    balance_rel_threshold: float = 1.5
    max_tree_chars: int = 1 << 24  # per worker

    def __post_init__(self) -> None:
        if not 0 <= self.cache_threshold <= 1:
            raise ValueError(f"cache_threshold must be in [0, 1], got {self.cache_threshold}")
        if self.balance_abs_threshold < 0 or self.balance_rel_threshold < 1 or self.max_tree_chars < CHUNK:
            raise ValueError("balance thresholds must be >= 0 (absolute) and >= 1 (relative), and a record must "
                             f"hold at least {CHUNK} characters")


def routing_key(body: Any) -> str:
    """What a request's prompt starts with, as text: ``text`` / ``prompt`` / chat ``messages`` (role and content, in
    order), else its ``input_ids``. Approximate on purpose: only the router's records compare it."""
    if not isinstance(body, dict):
        return ""
    for name in ("text", "prompt"):
        value = body.get(name)
        if isinstance(value, str):
            return value
        if isinstance(value, list) and value and isinstance(value[0], str):
            return value[0]  # a batch: route by its first prompt
    messages = body.get("messages")
    if isinstance(messages, list):
        return "".join(f"<{m.get('role')}>{m.get('content')}" for m in messages if isinstance(m, dict))
    ids = body.get("input_ids")
    return json.dumps(ids) if isinstance(ids, list) else ""


@dataclass(eq=False, slots=True)
class _Node:
    parent: _Node | None
    key: str = ""
    children: dict[str, _Node] = field(default_factory=dict)
    used: int = 0


class PrefixRecord:
    """The prefixes sent to one worker, in chunks of ``CHUNK`` characters."""

    def __init__(self, max_chars: int):
        self._root, self.max_chars, self.chars = _Node(None), max_chars, 0
        self._clock = itertools.count(1)
        self.evictions = 0  # rounds of eviction, each a walk of the whole tree

    def match(self, key: str) -> int:
        """How many leading characters of ``key`` this worker has seen (a multiple of ``CHUNK``)."""
        node, matched = self._root, 0
        for start in range(0, len(key) - CHUNK + 1, CHUNK):
            node = node.children.get(key[start:start + CHUNK])
            if node is None:
                break
            matched += CHUNK
        return matched

    def insert(self, key: str) -> None:
        node, now = self._root, next(self._clock)
        for start in range(0, len(key) - CHUNK + 1, CHUNK):
            chunk = key[start:start + CHUNK]
            child = node.children.get(chunk)
            if child is None:
                child = node.children[chunk] = _Node(node, chunk)
                self.chars += CHUNK
            child.used = now
            node = child
        if self.chars > self.max_chars:
            # down to a low-water mark, not just under the limit: a full record walks its tree once per
            # ``1 - EVICT_TO`` of its size inserted, not on every request (this runs on the router's event loop)
            self._evict(self.chars - int(self.max_chars * EVICT_TO))

    def _evict(self, chars: int) -> None:
        self.evictions += 1
        leaves, stack, order = [], list(self._root.children.values()), itertools.count()
        while stack:
            node = stack.pop()
            stack.extend(node.children.values())
            if not node.children:
                leaves.append((node.used, next(order), node))
        heapq.heapify(leaves)
        while leaves and chars > 0:
            _, _, node = heapq.heappop(leaves)
            del node.parent.children[node.key]
            self.chars -= CHUNK
            chars -= CHUNK
            if node.parent is not self._root and not node.parent.children:
                heapq.heappush(leaves, (node.parent.used, next(order), node.parent))


class CacheAwarePicker:
    """One record per worker URL; ``choose`` picks among the candidates and records the key at the chosen one."""

    def __init__(self, settings: CacheAwareSettings | None = None):
        self.settings = settings or CacheAwareSettings()
        self.records: dict[str, PrefixRecord] = {}

    def choose(self, candidates: Sequence[Any], key: str) -> Any:
        """``candidates``: workers with ``url`` and ``outstanding`` (the router's requests in flight there)."""
        s = self.settings
        loads = [w.outstanding for w in candidates]
        if max(loads) - min(loads) > s.balance_abs_threshold and max(loads) > s.balance_rel_threshold * min(loads):
            chosen = min(candidates, key=lambda w: w.outstanding)
        else:
            matched = {w.url: self._record(w.url).match(key) for w in candidates}
            best = max(candidates, key=lambda w: matched[w.url])
            if key and matched[best.url] / len(key) > s.cache_threshold:
                chosen = best
            else:
                chosen = min(candidates, key=lambda w: self._record(w.url).chars)
        self._record(chosen.url).insert(key)
        return chosen

    def _record(self, url: str) -> PrefixRecord:
        record = self.records.get(url)
        if record is None:
            record = self.records[url] = PrefixRecord(self.settings.max_tree_chars)
        return record
