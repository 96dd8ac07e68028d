"""The decode node's pull of a whole handoff: every piece of the room's resharding plan, and P's checksum entry.

With a progressive backend and a pool on one CPU device, the scatter starts during the pull instead of after it:
each group of layers is written as soon as it has landed (``StreamedScatter``), and ``Scatter`` only waits for the
last writes. A layer is final when it lands, and P's layout was checked before the first byte was accepted; what the
pull can still fail on is the rest of the stream, and then the room fails and its pages (some already written) are
freed behind every queued write, which finds the stream cancelled.

Different tensor-parallel sizes on P and D. The room is still one transfer: one ``Pull`` effect, one ``pulled`` or
``error`` event. Its plan (``transport/reshard.py``, from P's layout in READY and ours) has one piece per run of KV
slots a decode shard needs from a prefill shard, and the handler pulls every piece (its own uuid, ``piece_uuid``).
The room's pull is pending until every piece landed (``pulled`` then carries all of them, in plan order, to
``Scatter``, which assembles and writes them) or until the first piece fails: that error fails the room and names
the piece and both shards; pieces that land later find no pending pull and are discarded at once (``pulls.py``).

Without tensor parallelism, P may publish the handoff's checksum as one more entry once it has computed it (READY's
``checksum_entry``); the pull then also waits for that entry, and ``pulled`` carries the checksums to ``Scatter``.
"""

from __future__ import annotations

from functools import partial
from typing import TYPE_CHECKING, Any

from fsm_pd.effects.checksums import read_trailer
from fsm_pd.effects.chunked import TRAILER_WORDS, Trailer
from fsm_pd.effects.faults import Corruption, InjectedFault
from fsm_pd.effects.pulls import DecodePart, Pulls, report_pull_error
from fsm_pd.transport.reshard import Piece, ReshardPlan, piece_uuid, plan_between

if TYPE_CHECKING:
    from fsm_pd.effects import Node
    from fsm_pd.machines import Room


class RoomPull(DecodePart):
    """``DecodeEffects``'s pull of a whole handoff (a mixin: the handler holds the ports and the book)."""

    def _pull_room(self, node: Node, room: Room, pages: list[int]) -> None:
        ctx, room_id = room.ctx, room.room
        plan = plan_between(ctx["peer_layout"], self.layout)
        stream = self.kv.stream(pages) if plan.unsharded else None
        entry = bool(ctx.get("checksum_entry")) and plan.unsharded
        pulls = Pulls(plan, trailer=entry)
        self.book.start(room_id, pulls, stream)
        self.faults.crash("before_pull")
        for piece in plan.pieces:
            try:
                self.faults.check("pull")
            except InjectedFault as exc:
                self._piece_pulled(node, room_id, pulls, piece, None, None, exc)
                return
            corruption = self.faults.corrupting()
            done = partial(self._piece_pulled, node, room_id, pulls, piece, corruption)
            on_progress = None if stream is None else stream.on_progress
            if corruption is not None and on_progress is not None:  # the stream writes as the bytes land
                on_progress = corruption.hook(on_progress)
            self.puller.pull(ctx["transfer_addr"], piece_uuid(int(ctx["uuid"]), piece.index), len(pages),
                             float(ctx["deadlines"]["transfer"]), done=done, on_progress=on_progress,
                             delay_s=self.faults.pull_delay_s, piece=piece)
        if entry:  # the checksum, published once P has computed it (meanwhile the pull waits on P, like a chunk's)
            layers = int(self.layout["num_layers"])
            trailer = Trailer(len(plan.pieces), TRAILER_WORDS + 1 + layers)
            # held back like every pull (a slow link delays the entry too, as it does a chunked handoff's trailer)
            self.puller.pull(ctx["transfer_addr"], piece_uuid(int(ctx["uuid"]), trailer.index), 0,
                             float(ctx["deadlines"]["transfer"]), done=partial(self._sums_pulled, node, room_id, pulls),
                             delay_s=self.faults.pull_delay_s, piece=trailer)

    def _sums_pulled(self, node: Node, room_id: int, pulls: Pulls, staging: Any, error: BaseException | None) -> None:
        """The checksum entry of a whole handoff landed (or failed), on whatever thread the pull port reports from."""
        sums = None
        if error is None:
            try:
                _, sums = read_trailer(self.kv.read_trailer(staging), int(self.layout["num_layers"]))
            except Exception as exc:  # noqa: BLE001 - an entry we cannot read fails the pull, not the thread
                error = exc
            finally:
                self.kv.discard(staging)
        if error is not None:
            landed = self.book.fail(room_id, pulls)
            if landed is None:
                return  # FreePages already ran, or a piece failed: that is the room's story
            for array in landed:
                self.kv.discard(array)
            report_pull_error(node, room_id, "checksum entry: ", error)
        elif self.book.land(room_id, pulls, len(pulls.plan.pieces), sums):
            self._room_pulled(node, room_id, pulls)

    def _piece_pulled(self, node: Node, room_id: int, pulls: Pulls, piece: Piece, corruption: Corruption | None,
                      staging: Any, error: BaseException | None) -> None:
        """One piece's result, on whatever thread the pull port reports from."""
        plan: ReshardPlan = pulls.plan
        if error is None and corruption is not None:
            staging = corruption.landed(staging, self.kv.corrupt)
        if error is not None:  # the first piece to fail fails the room's pull
            for array in self.book.fail(room_id, pulls) or ():  # pieces that landed before it will never be scattered
                self.kv.discard(array)
            report_pull_error(node, room_id, "" if plan.unsharded else f"{piece.describe()}: ", error)
            return
        complete = self.book.land(room_id, pulls, piece.index, staging)
        if complete is None:  # FreePages already ran, or another piece failed: nobody will ever scatter this
            self.kv.discard(staging)
            if plan.unsharded:  # journaled as ignored, for replay to show the late pull (a piece's failure shows)
                node.submit(room_id, "pulled", {"bytes": int(staging.nbytes)})
        elif complete:
            self._room_pulled(node, room_id, pulls)

    def _room_pulled(self, node: Node, room_id: int, pulls: Pulls) -> None:
        """Every piece (and the checksum entry) of a room's pull landed: ``pulled``."""
        self.faults.crash("after_pull")
        arrays = pulls.arrays()
        payload: dict[str, Any] = {"bytes": sum(int(a.nbytes) for a in arrays)}
        if not pulls.plan.unsharded:  # per piece: from which prefill shard, into which decode shard, how many bytes
            payload["pieces"] = [[p.src, p.dst, int(a.nbytes)] for p, a in zip(pulls.plan.pieces, arrays, strict=True)]
        if pulls.trailer is not None:  # journaled, as READY's would be: Scatter compares them
            payload["kv_checksum"] = pulls.trailer
        node.submit(room_id, "pulled", payload)
