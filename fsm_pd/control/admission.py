"""Page admission on the decode node: who decides which pages a room's KV goes into.

``ReservePages`` asks the admission for pages; the answer comes back as a ``pages_reserved`` event.
``SchedulerAdmission``: an SGLang-style scheduler (the decode engine's ``Preallocation``) allocates pages itself and
hands them over with ``KVReceiver.send_metadata``; releasing them on failure is then the scheduler's job, which it is
told about. (The tests that drive a decode ``KVManager`` without a scheduler bring their own first-come admission,
``tests/pool_admission.py``.)

``release`` runs on the model thread (``FreePages`` is queued there), after any scatter still queued for the room.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from fsm_pd.effects import Node


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
