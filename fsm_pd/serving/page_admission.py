"""Admission by free pages: which waiting requests may take pages now.

A request is admitted when its prompt's pages fit and ``headroom`` pages stay free for the running sequences to
grow into (one more page every ``page_size`` generated tokens). When nothing holds pages at all the headroom is
waived, so a prompt that fits the pool always gets in eventually. Requests are admitted in arrival order: the head
of the queue waits for pages rather than being overtaken by smaller prompts forever.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable

from fsm_pd.model.buckets import prefill_fits
from fsm_pd.model.pages import PageAllocator, pages_for
from fsm_pd.serving.sequence import Sequence


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
