"""The schedulers' admission by free pages, without jax: the engines run it, and so does the simulation.

A request is admitted when its prompt's pages fit and ``headroom`` pages stay free for the running sequences to
grow into (one more page every ``page_size`` generated tokens). When nothing holds pages at all the headroom is
waived, so a prompt that fits the pool always gets in eventually. Requests are admitted in arrival order: the head
of the queue waits for pages rather than being overtaken by smaller prompts forever.

- ``take_prefill_batch``: the prompts a prefill step admits (prefill and colocated nodes, recomputes);
- ``plan_chunks``: what one prefill step computes of the admitted prompts, within the chunked-prefill budget (a long
  prompt prefills over several steps, SGLang's chunked prefill);
- ``admit_waiting``: the decode node's pre-allocation, SGLang's: reserve a waiting room's pages and hand them to its
  transfer (``KVManager.give_pages``) while running and transferring requests leave room (``prealloc.py`` is the
  decode node's queue around it);
- ``end_prefix`` / ``end_request``: a request lets its pages go, its prompt's full pages joining the prefix cache;
- ``flush_when_idle``: SGLang's ``/flush_cache``.

Queue entries need only ``key``, ``prompt_len`` and ``pages`` (a serving ``Sequence``, or the simulation's request).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from fsm_pd.kvpool.pages import PageAllocator, pages_for
from fsm_pd.kvpool.prefix_cache import NO_MATCH, Match, PrefixCache
from fsm_pd.model.input_buckets import MIN_TOKEN_BUCKET, prefill_fits, token_bucket

Sequence = Any  # anything with key, prompt_len, pages, meta and queued_at: typed loosely to stay jax-free
# SGLang's --chunked-prefill-size: padded prompt tokens one prefill step computes, and the longest chunk of one
# prompt. On 2 CPU cores SmolLM2 prefills 512 tokens in about 0.6 s: a colocated node's running streams wait no
# longer than that for a long prompt, and a step loses ~8% of the throughput of a 2048-token one (bench/model.py).
CHUNKED_PREFILL_SIZE = 512


def admits(allocator: PageAllocator, need: int, headroom: int, *, always: bool = False) -> bool:
    """``need`` pages fit with ``headroom`` to spare; on a pool nobody holds pages of, any that fit (the headroom is
    for what the holders grow by), unless ``always``."""
    if allocator.reserved_pages == 0 and not always:
        return need <= allocator.free_pages
    return need + headroom <= allocator.free_pages


@dataclass(frozen=True, slots=True)
class Chunk:
    """Prompt positions ``[start, start + length)`` of ``seq`` to prefill in this step."""

    seq: Any
    start: int
    length: int

    @property
    def last(self) -> bool:
        """This chunk ends the prompt: its logits give the first token."""
        return self.start + self.length >= self.seq.prompt_len


def plan_chunks(admitted: Iterable[Any], *, max_batch: int, budget: int, planned: Iterable[Chunk] = ()) -> list[Chunk]:
    """``planned`` and then the next chunk of each admitted prompt, in order, while the step stays within ``budget``
    padded tokens (``prefill_fits``): the first prompt always gets a chunk, shrunk to a bucket that fits; a
    later one only a chunk that fits beside those before it. Entries need ``prompt_len`` and ``prefilled``."""
    chunks = list(planned)
    longest = max((c.length for c in chunks), default=0)
    for seq in admitted:
        if len(chunks) >= max_batch:
            break
        length = min(seq.prompt_len - seq.prefilled, budget)
        while not prefill_fits(len(chunks) + 1, max(longest, length), budget):
            if length <= MIN_TOKEN_BUCKET:
                return chunks
            length = token_bucket(length) // 2  # the next bucket down
        chunks.append(Chunk(seq, seq.prefilled, length))
        longest = max(longest, length)
    return chunks


def locked_if_it_fits(cache: PrefixCache | None, allocator: PageAllocator, prefix: Match, need: int,
                      headroom: int, *, always: bool = False) -> bool:
    """Lock a request's matched prefix, then see whether the ``need`` pages it lacks fit: locked first, because the
    prefix's own unlocked pages count as evictable and are not there to evict for it. Unlocked again if not."""
    if cache is not None:
        cache.lock(prefix)
    if admits(allocator, need, headroom, always=always):
        return True
    if cache is not None:
        cache.unlock(prefix)
    return False


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
    planned: Iterable[Chunk] = (),
    headroom_always: bool = False,
) -> list[Sequence]:
    """Pop up to ``max_batch`` prompts (their first chunks within ``max_tokens`` padded tokens in all:
    ``prefill_fits``; always at least one) off the head of ``queue`` and reserve their pages. ``drop(seq)``
    says a queued request is gone (aborted, its room failed): it is popped and skipped. Model thread only; other
    threads only append to ``queue``.

    With a ``cache``, a prompt's longest cached prefix (whole pages, leaving at least one token to compute) is locked
    and becomes its first pages (``seq.prefix``); only the rest is reserved, and only the rest counts against the
    token budget. A request that asked for its prompt's logprobs computes the whole prompt. ``planned``: chunks this
    step already runs (of prompts admitted before), which the new prompts' first chunks must fit beside.
    ``headroom_always``: the headroom holds on an idle pool too (``admits``).
    """
    planned = list(planned)
    batch: list[Sequence] = []
    longest = max((c.length for c in planned), default=0)
    while queue and len(batch) < max_batch:
        seq = queue[0]
        if drop(seq):
            queue.popleft()
            continue
        prefix = NO_MATCH
        if cache is not None and not seq.request.return_logprob:
            prefix = cache.match(seq.request.input_ids, max_pages=(seq.prompt_len - 1) // page_size)
        computed = min(seq.prompt_len - prefix.tokens, max_tokens)  # the first chunk of a longer prompt
        if not prefill_fits(len(planned) + len(batch) + 1, max(longest, computed), max_tokens):
            break
        need = pages_for(seq.prompt_len, page_size) - len(prefix.pages)
        if not locked_if_it_fits(cache, allocator, prefix, need, headroom, always=headroom_always):
            break
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
        seq.prefix, seq.pages, seq.prefilled = prefix, [*prefix.pages, *new], prefix.tokens
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
        if not locked_if_it_fits(cache, allocator, prefix, need, headroom):
            break
        queue.popleft()
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


def end_request(cache: PrefixCache | None, allocator: PageAllocator, room: int, seq: Sequence | None, *,
                keep: bool) -> None:
    """A prefill-side room ended: with its request, as ``end_prefix`` (``keep``: it was handed over, its prompt's
    pages join the cache); without one, whatever the room holds is freed. Either way the allocator forgets the room:
    nothing reserves for it after this, as admission drops requests whose room ended. Model thread."""
    if seq is not None:
        end_prefix(cache, allocator, seq, keep=keep)
    else:
        allocator.free(room)
    allocator.forget(room)


def flush_when_idle(allocator: PageAllocator, live: int, cache: PrefixCache | None = None) -> tuple[bool, str]:
    """SGLang's ``/flush_cache`` on an engine with ``live`` requests; model thread only: empties the prefix cache
    and puts the pool's free pages back in their starting order. Refused (False) while a request is live or a page
    is held, as SGLang refuses while requests run or wait."""
    if live or allocator.reserved_pages:
        return False, (f"Cache not flushed: {live} requests are live and {allocator.reserved_pages} KV pages "
                       f"reserved; flush when the node is idle.")
    dropped = cache.clear() if cache is not None else 0
    allocator.reset_order()
    return True, f"Cache flushed: {dropped} cached KV pages dropped; the pool's free pages are back in starting order."
