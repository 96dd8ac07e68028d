"""The table of an engine's live requests, that ``submit`` records in and ``abort`` works through."""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING

from fsm_pd.serving.types import EngineError

if TYPE_CHECKING:
    from fsm_pd.serving.sequence import Sequence

ABORTED_STATUS = 499  # the client gave up (nginx's "client closed request"); not a server failure


class RequestTable:
    """rid → live ``Sequence``, from ``submit`` until the request ends or is aborted. Thread-safe."""

    def __init__(self) -> None:
        self._live: dict[str, Sequence] = {}
        self._lock = threading.Lock()

    def add(self, seq: Sequence) -> None:
        with self._lock:
            if seq.rid in self._live:
                raise EngineError(f"request {seq.rid} is already running", 400)
            self._live[seq.rid] = seq

    def get(self, rid: str | None) -> Sequence | None:
        with self._lock:
            return self._live.get(rid)

    def pop(self, rid: str) -> Sequence | None:
        with self._lock:
            return self._live.pop(rid, None)

    def cancel(self, rid: str, reason: str = "aborted", status: int = ABORTED_STATUS) -> Sequence | None:
        """Mark the request cancelled and end its stream with ``EngineError(status)`` (499: the client gave up; a
        drain past its bound says 503); None if it is not live.

        The scheduler frees what it holds at its next step on the model thread.
        """
        with self._lock:
            seq = self._live.pop(rid, None)
        if seq is None:
            return None
        seq.cancelled = True  # first, so the model thread stops streaming to it as early as possible
        seq.stream.push(EngineError(f"request {rid} {reason}", status))
        return seq

    def fail_all(self, error: Exception) -> int:
        """End every live request with ``error`` (the engine can no longer serve); returns how many."""
        with self._lock:
            live, self._live = list(self._live.values()), {}
        for seq in live:
            seq.cancelled = True  # nothing may stream to it after its error
            seq.stream.push(error)
        return len(live)

    def __len__(self) -> int:
        with self._lock:
            return len(self._live)
