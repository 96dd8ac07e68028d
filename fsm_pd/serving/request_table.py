"""The table of an engine's live requests, by identity, that ``submit`` records in and ``abort`` works through.

A request's identity is ``GenerateRequest.identity``: its rid and, on a PD node, its bootstrap room. A router runs
every attempt of one client request with the client's rid and a new room, so on a PD node a retry is a different
request from the attempt it replaces (even while that one is still winding down), and an abort that names the room
reaches its own attempt only. An abort by rid alone keeps SGLang's meaning: every live request of that rid.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from typing import TYPE_CHECKING

from fsm_pd.serving.types import EngineError

if TYPE_CHECKING:
    from fsm_pd.serving.sequence import Sequence

log = logging.getLogger(__name__)

ABORTED_STATUS = 499  # the client gave up (nginx's "client closed request"); not a server failure
# Rooms aborted before their request arrived, kept to refuse that request. It comes within milliseconds (it was on its
# way when the abort was sent); the bound keeps the memory flat however many aborts find nothing.
ABORTS_REMEMBERED = 1024


class RequestTable:
    """The live requests by identity (``GenerateRequest.identity``: rid and room on a PD node, the rid on a colocated
    one), from ``submit`` until the request ends or is aborted. Thread-safe.

    An abort that names a room no live request holds is remembered (the last ``ABORTS_REMEMBERED`` of them), and a
    request that brings that room later is refused with 499. A router's abort of a failed attempt can reach the node
    before the attempt's own request does (its partner failed at once: a draining prefill's 503); that request would
    otherwise register afterwards and wait for a peer that never opens its room. A room is used once per node (a
    reused one is refused, 409), so remembering it can refuse nothing but that late request.
    """

    def __init__(self) -> None:
        self._live: dict[tuple[str, int | None], Sequence] = {}
        self._aborted_rooms: OrderedDict[int, None] = OrderedDict()  # aborted before their request came, oldest first
        self._lock = threading.Lock()

    def add(self, seq: Sequence) -> None:
        rid, room = seq.identity
        with self._lock:  # the same lock as ``cancel``: an abort is either seen here or finds the request live
            if room is not None and room in self._aborted_rooms:
                del self._aborted_rooms[room]
                log.info("request %s (room %d) refused: its abort came before it", rid, room)  # the race, when seen
                raise EngineError(f"request {rid} (room {room}) was aborted before it arrived", ABORTED_STATUS)
            if seq.identity in self._live:
                where = f" in room {room}" if room is not None else ""
                raise EngineError(f"request {rid} is already running{where}", 400)
            self._live[seq.identity] = seq

    def get(self, rid: str | None, room: int | None = None) -> Sequence | None:
        with self._lock:
            return self._live.get((rid, room))

    def pop(self, seq: Sequence) -> None:
        """Forget ``seq`` (it ended); nothing if it is no longer the live request of its identity."""
        with self._lock:
            if self._live.get(seq.identity) is seq:
                del self._live[seq.identity]

    def cancel(self, rid: str, room: int | None = None, reason: str = "aborted",
               status: int = ABORTED_STATUS) -> list[Sequence]:
        """Mark the requests cancelled and end their streams with ``EngineError(status)`` (499: the client gave up;
        a drain past its bound says 503); returns them. ``room`` None: every live request of ``rid``; a room: the
        request with that identity, and when none is live the room is remembered (see the class).

        The scheduler frees what they hold at its next step on the model thread.
        """
        with self._lock:
            if room is None:
                seqs = [seq for (live_rid, _), seq in self._live.items() if live_rid == rid]
            else:
                seq = self._live.get((rid, room))
                seqs = [seq] if seq is not None else []
                if seq is None:
                    self._aborted_rooms[room] = None
                    if len(self._aborted_rooms) > ABORTS_REMEMBERED:
                        self._aborted_rooms.popitem(last=False)
            for seq in seqs:
                del self._live[seq.identity]
        for seq in seqs:
            seq.cancelled = True  # first, so the model thread stops streaming to it as early as possible
            seq.stream.push(EngineError(f"request {rid} {reason}", status))
        return seqs

    def fail_all(self, error: Exception) -> int:
        """End every live request with ``error`` (the engine can no longer serve); returns how many."""
        with self._lock:
            live, self._live = list(self._live.values()), {}
        for seq in live:
            seq.cancelled = True  # nothing may stream to it after its error
            seq.stream.push(error)
        return len(live)

    def live(self) -> list[Sequence]:
        with self._lock:
            return list(self._live.values())

    def __len__(self) -> int:
        with self._lock:
            return len(self._live)
