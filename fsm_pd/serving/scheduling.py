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
) -> list[Sequence]:
    """Pop up to ``max_batch`` prompts (``max_tokens`` padded tokens in all: ``buckets.prefill_fits``; always at
    least one) off the head of ``queue`` and reserve their pages. ``drop(seq)`` says a queued request is gone
    (aborted, its room failed): it is popped and skipped. Model thread only; other threads only append to
    ``queue``.
    """
    batch: list[Sequence] = []
    longest = 0
    while queue and len(batch) < max_batch:
        seq = queue[0]
        if drop(seq):
            queue.popleft()
            continue
        if not prefill_fits(len(batch) + 1, max(longest, seq.prompt_len), max_tokens):
            break
        need = pages_for(seq.prompt_len, page_size)
        if not admits(allocator, need, headroom):
            break
        try:
            seq.pages = allocator.reserve(seq.key, need)
        except ValueError:  # its key was freed already: the request ended while it waited
            queue.popleft()
            continue
        queue.popleft()
        seq.meta["queue_time"] = round(time.monotonic() - seq.queued_at, 6)  # SGLang's name: waiting -> forward
        batch.append(seq)
        longest = max(longest, seq.prompt_len)
    return batch


def admit_waiting(queue: deque, allocator: PageAllocator, page_size: int, *, headroom: int, room_for: int,
                  gone: Callable[[Any], bool], grant: Callable[[int, list[int]], None]) -> int:
    """Reserve the prompt pages of the head of ``queue`` and ``grant(key, pages)`` them, in arrival order, for up to
    ``room_for`` requests. ``gone(entry)`` says a waiting request ended (aborted, its room failed): it is popped and
    skipped. Returns how many were granted. Model thread only (the scheduler's, or the simulation's)."""
    granted = 0
    while queue and granted < room_for:
        entry = queue[0]
        if gone(entry):
            queue.popleft()
            continue
        need = pages_for(entry.prompt_len, page_size)
        if not admits(allocator, need, headroom):
            break
        queue.popleft()
        try:
            pages = allocator.reserve(entry.key, need)
        except ValueError:  # freed already: the room failed while it waited
            continue
        grant(entry.key, pages)
        granted += 1
    return granted
