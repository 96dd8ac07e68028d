"""The schedulers' admission by free pages, without jax: the engines run it, and so does the simulation.

A request is admitted when its prompt's pages fit and ``headroom`` pages stay free for the running sequences to
grow into (one more page every ``page_size`` generated tokens). When nothing holds pages at all the headroom is
waived, so a prompt that fits the pool always gets in eventually. Requests are admitted in arrival order: the head
of the queue waits for pages rather than being overtaken by smaller prompts forever.

- ``take_prefill_batch``: the prompts a prefill step runs (prefill and colocated nodes, recomputes);
- ``admit_waiting``: the decode node's pre-allocation, SGLang's: reserve a waiting room's pages and hand them to its
  transfer (``KVManager.give_pages``) while running and transferring requests leave room.

Queue entries need only ``key``, ``prompt_len`` and ``pages`` (a serving ``Sequence``, or the simulation's request).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from typing import Any

from fsm_pd.model.buckets import prefill_fits
from fsm_pd.model.pages import PageAllocator, pages_for
from fsm_pd.model.prefix_cache import NO_MATCH, PrefixCache

Sequence = Any  # anything with key, prompt_len, pages, meta and queued_at: typed loosely to stay jax-free


def admits(allocator: PageAllocator, need: int, headroom: int) -> bool:
    if allocator.reserved_pages == 0:
        return need <= allocator.free_pages
    return need + headroom <= allocator.free_pages


def take_prefill_batch(
    queue: deque[Sequence],
    allocator: PageAllocator,
    page_size: int,
    *,
    max_batch: int,
    max_tokens: int,
    headroom: int,
    drop: Callable[[Sequence], bool],
    cache: PrefixCache | None = None,
) -> list[Sequence]:
    """Pop up to ``max_batch`` prompts (``max_tokens`` padded tokens in all: ``buckets.prefill_fits``; always at
    least one) off the head of ``queue`` and reserve their pages. ``drop(seq)`` says a queued request is gone
    (aborted, its room failed): it is popped and skipped. Model thread only; other threads only append to
    ``queue``.

    With a ``cache``, a prompt's longest cached prefix (whole pages, leaving at least one token to compute) is locked
    and becomes its first pages (``seq.prefix``); only the rest is reserved, and only the rest counts against the
    token budget. A request that asked for its prompt's logprobs computes the whole prompt.
    """
    batch: list[Sequence] = []
    longest = 0
    while queue and len(batch) < max_batch:
        seq = queue[0]
        if drop(seq):
            queue.popleft()
            continue
        prefix = NO_MATCH
        if cache is not None and not seq.request.return_logprob:
            prefix = cache.match(seq.request.input_ids, max_pages=(seq.prompt_len - 1) // page_size)
        computed = seq.prompt_len - prefix.tokens
        if not prefill_fits(len(batch) + 1, max(longest, computed), max_tokens):
            break
        need = pages_for(seq.prompt_len, page_size) - len(prefix.pages)
        if not admits(allocator, need, headroom):
            break
        if cache is not None:
            cache.lock(prefix)  # before the reservation: it must not evict the pages we are about to use
        try:
            new = allocator.reserve(seq.key, need)
        except ValueError:  # its key was freed already: the request ended while it waited
            if cache is not None:
                cache.unlock(prefix)
            queue.popleft()
            continue
        queue.popleft()
        if cache is not None:
            cache.record(prefix, seq.prompt_len)
        seq.prefix, seq.pages = prefix, [*prefix.pages, *new]
        seq.meta["cached_tokens"] = prefix.tokens
        seq.meta["queue_time"] = round(time.monotonic() - seq.queued_at, 6)  # SGLang's name: waiting -> forward
        batch.append(seq)
        longest = max(longest, computed)
    return batch


def end_prefix(cache: PrefixCache | None, allocator: PageAllocator, seq: Sequence, *, keep: bool,
               free: bool = True) -> None:
    """A request is done with its pages: with ``keep`` (its prompt's KV is in them), the full pages of its prompt
    that the cache lacks join it; its cached prefix is unlocked; with ``free``, whatever else it held is freed (a
    decode node's machine frees them itself, later). Model thread."""
    if cache is not None:
        if keep:
            allocator.adopt(seq.key, cache.insert(seq.request.input_ids, seq.pages))
        cache.unlock(seq.prefix)
        seq.prefix = NO_MATCH
    if free:
        allocator.free(seq.key)


def admit_waiting(queue: deque, allocator: PageAllocator, page_size: int, *, headroom: int, room_for: int,
                  gone: Callable[[Any], bool], grant: Callable[[int, list[int], int], None],
                  cache: PrefixCache | None = None) -> int:
    """Reserve the prompt pages of the head of ``queue`` and ``grant(key, pages, cached_pages)`` them, in arrival
    order, for up to ``room_for`` requests. ``gone(entry)`` says a waiting request ended (aborted, its room failed):
    it is popped and skipped. With a ``cache`` (the decode node's own), the longest cached prefix of the prompt in
    whole pages is locked and becomes its first ``cached_pages`` pages: the transfer fills only the rest. Returns
    how many were granted. Model thread only (the scheduler's, or the simulation's)."""
    granted = 0
    while queue and granted < room_for:
        entry = queue[0]
        if gone(entry):
            queue.popleft()
            continue
        prefix = cache.match(entry.request.input_ids) if cache is not None else NO_MATCH
        need = pages_for(entry.prompt_len, page_size) - len(prefix.pages)
        if not admits(allocator, need, headroom):
            break
        queue.popleft()
        if cache is not None:
            cache.lock(prefix)
        try:
            new = allocator.reserve(entry.key, need) if need else []
        except ValueError:  # freed already: the room failed while it waited
            if cache is not None:
                cache.unlock(prefix)
            continue
        if cache is not None:
            cache.record(prefix, entry.prompt_len)
        entry.prefix, entry.pages = prefix, [*prefix.pages, *new]
        grant(entry.key, entry.pages, len(prefix.pages))
        granted += 1
    return granted
