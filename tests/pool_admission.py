"""A first-come page admission for the tests that drive a decode ``KVManager`` with no scheduler beside it (the
transfer, control-plane and fault tests): it allocates each room's ``page_count`` from its own allocator, in arrival
order, the head waiting for free pages. Serving never does this: the decode engine's scheduler owns the pages
(``SchedulerAdmission``); this is the ``Admission`` port's test double."""

from __future__ import annotations

import threading
from collections import deque
from typing import TYPE_CHECKING

from fsm_pd.kvpool.pages import OutOfPages, PageAllocator

if TYPE_CHECKING:
    from fsm_pd.effects import Node


def pool_admission(num_pages: int) -> PoolAdmission:
    return PoolAdmission(PageAllocator(num_pages))


class PoolAdmission:
    def __init__(self, allocator: PageAllocator):
        self.allocator = allocator
        self._queue: deque[tuple[int, int]] = deque()
        self._lock = threading.Lock()

    def request(self, node: Node, room: int, count: int | None) -> None:
        if count is None:
            raise ValueError(f"room {room} has no page_count: the pool admission needs one")
        with self._lock:
            self._queue.append((room, int(count)))
        self.grant(node)

    def grant(self, node: Node) -> None:
        """Admit in arrival order; the head waits for pages. A room that ended left the queue in ``release`` (every
        failed room's ``FreePages`` calls it), so no room's state is read here, off the loop."""
        with self._lock:
            while self._queue:
                room, count = self._queue[0]
                try:
                    pages = self.allocator.reserve(room, count)
                except OutOfPages:
                    return
                except ValueError as exc:  # can never fit, a reused room id, or freed while it queued here
                    self._queue.popleft()
                    node.submit(room, "error", {"blame": "local", "reason": str(exc)})
                    continue
                self._queue.popleft()
                node.submit(room, "pages_reserved", {"pages": pages})

    def release(self, node: Node, room: int) -> int:
        with self._lock:
            if any(waiting == room for waiting, _ in self._queue):
                self._queue = deque(item for item in self._queue if item[0] != room)
        freed = self.allocator.free(room)
        self.grant(node)
        return freed

    def counters(self) -> dict:
        return {"pages_reserved": self.allocator.reserved_pages, "pages_free": self.allocator.free_pages,
                "rooms_waiting_for_pages": len(self._queue)}
