"""The decode node's pre-allocation queue (SGLang's): its engine's scheduler and the simulation both run this one.

A request waits here, in arrival order, until its prompt's pages fit with ``headroom`` to spare; then ``admit``
reserves them (locking the longest prefix the node's own cache holds: those pages need no transfer) and hands them
to the room's transfer (``grant``: ``KVManager.give_pages`` or ``NodeCore.give_pages``). From then on the room's
machine decides when the pages go back: its ``FreePages``, through ``SchedulerAdmission``, calls ``release``.
``failed`` and ``finished`` settle only the prefix cache: a failed room's cached prefix is unlocked, a finished
one's prompt pages join the cache first (what ``FreePages`` frees after is the rest).

Model thread only (the engine's, or the simulation's), like the allocator's reservations; ``queue`` reads what
waits from any thread. No jax here.

How long a request may wait here is its room's ``admission`` deadline (``fsm_pd/machines/receiver.py``), armed once
the prefill node's address is known: a request queued behind memory pressure is not failed as if its prefill node
could not be found, and one that waited too long says it waited for free KV pages.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import Any

from fsm_pd.kvpool.pages import PageAllocator
from fsm_pd.kvpool.prefix_cache import PrefixCache
from fsm_pd.scheduling.page_admission import admit_waiting, end_prefix


class Preallocation:
    def __init__(self, allocator: PageAllocator, page_size: int, *, headroom: int,
                 grant: Callable[[int, list[int], int], None], cache: PrefixCache | None = None,
                 kick: Callable[[], None] = lambda: None):
        self.allocator, self.page_size, self.headroom = allocator, page_size, headroom
        self.grant, self.cache, self.kick = grant, cache, kick
        self.waiting: deque[Any] = deque()  # entries with key, prompt_len, request.input_ids; admit sets pages, prefix

    def admit(self, room_for: int, gone: Callable[[Any], bool]) -> int:
        """Grant pages to up to ``room_for`` waiting requests, head first; ``gone(entry)``: its room ended."""
        return admit_waiting(self.waiting, self.allocator, self.page_size, headroom=self.headroom, room_for=room_for,
                             gone=gone, grant=self.grant, cache=self.cache)

    def queue(self, now: float) -> dict:
        """What waits for pages, for ``/health`` and ``/metrics``: how many requests and how long the oldest has
        waited (``now`` minus its ``queued_at``). Any thread: a deque's length and head are read atomically; a request
        that ended while queued counts until the queue reaches it."""
        try:
            head = self.waiting[0]
        except IndexError:
            return {"prealloc_queue": 0, "prealloc_oldest_wait_s": 0.0}
        return {"prealloc_queue": len(self.waiting), "prealloc_oldest_wait_s": round(max(0.0, now - head.queued_at), 3)}

    def release(self, room: int) -> None:
        """The room's machine frees its pages (it failed, or its request finished): ``SchedulerAdmission``'s
        ``on_release``. Nothing reserves for the room after this: ``admit`` drops entries whose room ended (``gone``,
        read on this same thread), so the allocator need not remember it."""
        self.allocator.free(room)
        self.allocator.forget(room)
        self.kick()

    def failed(self, entry: Any) -> None:
        """The room failed: its cached prefix goes back (its own pages are its ``FreePages``')."""
        end_prefix(self.cache, self.allocator, entry, keep=False, free=False)

    def finished(self, entry: Any) -> None:
        """The request is done: its prompt's full pages the cache lacks join it, its cached prefix is unlocked."""
        end_prefix(self.cache, self.allocator, entry, keep=True, free=False)
