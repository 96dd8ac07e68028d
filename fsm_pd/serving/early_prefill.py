"""``EarlyPrefill``: on one pool (``--role pd``), a room's prompt is prefilled before the decode engine's PREPARE.

SGLang's prefill node queues a prompt for its prefill only once the room is bootstrapped: the decode node's PREPARE
says it reserved pages the KV can go to, so no compute is spent on KV with nowhere to go. On one pool the KV goes
nowhere: the handoff moves the pages' ownership (``control/pool_kv.py``). Waiting for PREPARE there only put the
decode engine's admission, which runs in its own step, in front of every prefill: 9.8 ms of a decode-heavy
request's TTFT on the chip (round r13, ``P transfer bootstrap``), about as much as the queue and the prefill
together.

So a prompt joins this queue when it arrives and is prefilled when the pages allow; only its handoff
(``kv_ready``) waits for PREPARE, as before. The machines, their journals and replay are unchanged: the room stays
in Bootstrapping while its prompt computes, and goes on from WaitingForInput as any other.

The bound (why a decode engine can still prepare every room prefilled early): an early prompt takes its pages only
if the pool keeps free what the decode engine will reserve for every room not yet prepared, this one included (their
prompts' pages), plus the headroom it keeps for its streams. Without it, prompts that no decode stream could take
filled the pool, and the rooms waited for their bootstrap deadline. A prompt that does not fit so waits for its
PREPARE and is prefilled then, as before.

Model thread only, like the prefill engine's other queues.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable

from fsm_pd.kvpool.pages import PageAllocator, pages_for
from fsm_pd.scheduling.page_admission import admits
from fsm_pd.serving.sequence import Sequence


class EarlyPrefill:
    def __init__(self, page_size: int, decode_headroom: Callable[[], int]):
        """``decode_headroom()``: the pages the decode engine keeps free when it reserves a prompt's."""
        self.page_size, self.decode_headroom = page_size, decode_headroom
        self.queue: deque[Sequence] = deque()  # arrived, not yet prefilling: the prefill engine's second queue
        self._unprepared: dict[int, int] = {}  # room -> its prompt's pages, until its PREPARE arrives

    def arrived(self, seq: Sequence) -> None:
        seq.queued_at = time.monotonic()
        self.queue.append(seq)
        self._unprepared[seq.key] = pages_for(seq.prompt_len, self.page_size)

    def prepared(self, room: int) -> bool:
        """The room reached WaitingForInput; True if it was one of ours (its prompt queued, computing or done)."""
        return self._unprepared.pop(room, None) is not None

    def ended(self, room: int) -> None:
        self._unprepared.pop(room, None)

    def unprepared(self, room: int) -> bool:
        """Its PREPARE has not arrived: a prompt prefilled early waits for it before ``kv_ready``."""
        return room in self._unprepared

    def waiting(self, allocator: PageAllocator) -> bool:
        """A prompt here that may be prefilled early now: unprepared, and its pages fit beside the headroom. One the
        pool has no room for waits for its PREPARE, and meanwhile does not hold the decode engine to one step a
        dispatch (``SharedPool.prefill_waiting``)."""
        headroom = self.headroom()
        return any(seq.key in self._unprepared and admits(allocator, pages_for(seq.prompt_len, self.page_size),
                                                           headroom, always=True) for seq in self.queue)

    def headroom(self) -> int:
        """Pages an early prompt must leave free (module docstring)."""
        return self.decode_headroom() + sum(self._unprepared.values())

    def info(self) -> dict:
        """``/server_info``: prompts queued here, and rooms (queued, computing or done) still without PREPARE."""
        return {"early_queue": sum(seq.key in self._unprepared for seq in self.queue),
                "unprepared_rooms": len(self._unprepared)}
