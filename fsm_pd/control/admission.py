"""Page admission on the decode node: who decides which pages a room's KV goes into.

``ReservePages`` asks the admission for pages; the answer comes back as a ``pages_reserved`` event. Two policies:

- ``PoolAdmission``: fsm-pd's own allocator and a first-come queue (the built-in decode server, the tests);
- ``SchedulerAdmission``: an SGLang-style scheduler allocates pages itself and hands them over with
  ``KVReceiver.send_metadata``; releasing them on failure is then the scheduler's job, which it is told about.

``release`` runs on the model thread (``FreePages`` is queued there), after any scatter still queued for the room.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING

from fsm_pd.model.pages import OutOfPages, PageAllocator

if TYPE_CHECKING:
    from fsm_pd.effects import Node


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


class SchedulerAdmission:
    """The scheduler owns the pages. ``on_release(room)`` tells it when a failed room's pages may be reused."""

    def __init__(self, on_release: Callable[[int], None] | None = None):
        self.on_release = on_release

    def request(self, node: Node, room: int, count: int | None) -> None:
        pass  # the scheduler calls KVReceiver.send_metadata when it has allocated the pages

    def release(self, node: Node, room: int) -> int:
        if self.on_release is not None:
            self.on_release(room)
        return 0

    def counters(self) -> dict:
        return {}
