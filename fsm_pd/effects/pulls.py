"""The decode node's pulls in flight and the pulled buffers waiting for ``Scatter``: who owns each buffer.

A room's pull has *entries*: the pieces of its plan (one for a whole handoff without tensor parallelism, one per
run of slots of a resharding plan, one per chunk piece of a chunked handoff) and, where P sends one, a trailer (the
checksum entry of a whole handoff, the first token and checksums of a chunked one). The pull is *pending* from
``Pull`` until its last entry lands or its first one fails. If the room is still pending when the last entry lands,
its arrays go to ``pulled`` until ``Scatter`` takes them (and discards them once written); the first entry to fail
ends the pull, and the arrays that landed before it are discarded then. If ``FreePages`` ran first (the room failed
while the pull was in flight), it discards what had landed, and every entry that lands later finds its pull over and
is discarded at once. One lock orders all of these, so every pulled buffer is discarded exactly once, whichever comes
first. The three pull shapes (``room_pull.py``, ``chunk_pull.py``) share this book; no jax here.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any

from fsm_pd.transport.backends.base import TransferFailed, TransferTimeout

if TYPE_CHECKING:
    from fsm_pd.effects import Node
    from fsm_pd.effects.faults import Faults
    from fsm_pd.effects.ports import DecodeKV, ModelExecutor, PullPort


class Pulls:
    """The entries of one room's pull that have landed: ``plan.pieces`` (by index, kept until Scatter), then, if
    ``trailer``, the trailer (index ``len(plan.pieces)``: what was read from it, the array itself is not kept)."""

    def __init__(self, plan: Any, trailer: bool = False):
        self.plan = plan
        self.landed: dict[int, Any] = {}  # piece index -> its verified array
        self.waits_for_trailer = trailer
        self.trailer: Any = None

    def land(self, index: int, value: Any) -> bool:
        if index < len(self.plan.pieces):
            self.landed[index] = value
        else:
            self.trailer, self.waits_for_trailer = value, False
        return self.complete

    @property
    def complete(self) -> bool:
        return len(self.landed) == len(self.plan.pieces) and not self.waits_for_trailer

    def arrays(self) -> tuple:
        """The pieces' arrays in plan order, whatever order they landed in."""
        return tuple(self.landed[piece.index] for piece in self.plan.pieces)


class PullBook:
    """Rooms whose pull has not ended (``pending``), their arrays waiting for Scatter (``pulled``: None when the
    prefix cache held every page) and the streamed writes of pulls still landing (``streams``), behind one lock. The
    book only moves arrays between owners; the caller discards what a method hands back."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.pending: dict[int, Pulls] = {}
        self.pulled: dict[int, tuple | None] = {}
        self.streams: dict[int, Any] = {}

    def start(self, room_id: int, pulls: Pulls, stream: Any = None) -> None:
        with self.lock:
            self.pending[room_id] = pulls
            if stream is not None:  # registered before the pull starts, so that FreePages can always cancel it
                self.streams[room_id] = stream

    def nothing_to_pull(self, room_id: int) -> None:
        with self.lock:
            self.pulled[room_id] = None

    def land(self, room_id: int, pulls: Pulls, index: int, value: Any) -> bool | None:
        """Entry ``index`` of ``pulls`` landed: True if that completes the pull (its arrays now wait for Scatter),
        False while other entries are missing, None if the pull is over (FreePages ran, or an entry failed): nobody
        will ever scatter ``value``, the caller discards it."""
        with self.lock:
            if self.pending.get(room_id) is not pulls:
                return None
            if not pulls.land(index, value):
                return False
            del self.pending[room_id]
            self.pulled[room_id] = pulls.arrays()
            return True

    def fail(self, room_id: int, pulls: Pulls) -> tuple | None:
        """An entry of ``pulls`` failed: the first failure ends the pull and hands back the arrays that landed
        before it (they will never be scattered); None if the pull was over already."""
        with self.lock:
            if self.pending.get(room_id) is not pulls:
                return None
            del self.pending[room_id]
        return tuple(pulls.landed.values())

    def take(self, room_id: int) -> tuple[tuple | None, Any]:
        """Scatter: the room's pulled arrays and its stream, if any."""
        with self.lock:
            return self.pulled.pop(room_id), self.streams.pop(room_id, None)

    def drop(self, room_id: int) -> tuple[tuple, Any]:
        """FreePages: the room's arrays (pulled, or landed of a pull in flight, whose later entries then find it
        over and discard themselves) and its stream, if any."""
        with self.lock:
            pulls = self.pending.pop(room_id, None)
            arrays = self.pulled.pop(room_id, None) or (() if pulls is None else tuple(pulls.landed.values()))
            return arrays, self.streams.pop(room_id, None)


class DecodePart:
    """What the parts of ``DecodeEffects`` (``room_pull.py``, ``chunk_pull.py``, ``scatter.py``) share: the
    handler's ports and settings and its pull book, set by ``DecodeEffects.__init__``."""

    layout: dict
    kv_checksum: bool
    puller: PullPort
    model: ModelExecutor
    kv: DecodeKV
    faults: Faults
    book: PullBook


def report_pull_error(node: Node, room_id: int, which: str, error: BaseException) -> None:
    """The room's ``error`` event for a failed pull; ``which`` names the entry (empty for a single-piece pull). An
    entry the prefill node failed says so in its reason (``PRODUCER_FAILED``): the decode node does not recompute
    such a prompt (``decode_engine``), since the prefill node answered its leg with the failure and a router computes
    it again elsewhere; it still tells the prefill node (ABORT), whose room may live on (a shard's entry lost)."""
    if isinstance(error, TransferTimeout):
        node.submit(room_id, "error", {"blame": "timeout", "reason": f"pull timed out: {which}{error}"})
    elif isinstance(error, TransferFailed):
        node.submit(room_id, "error", {"blame": error.blame, "reason": f"pull failed: {which}{error.reason}"})
    else:
        node.submit(room_id, "error", {"blame": "local", "reason": f"pull failed: {which}{error}"})


def pages_to_receive(ctx: dict) -> list[int]:
    """The room's pages a transfer fills: all of them, but the leading ones our prefix cache already holds."""
    return list(ctx["pages"])[int(ctx.get("cached_pages", 0)):]
