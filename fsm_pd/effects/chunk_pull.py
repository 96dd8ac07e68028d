"""The decode node's pull of a chunked handoff (READY with ``chunks``: ``chunked.py``).

It is pulled piece after piece, each parked on the prefill node until its chunk is computed, then the trailer;
``pulled`` (with the first token from the trailer, and the pieces' checksums if P sent them) reports once the trailer
landed, and ``Scatter`` writes every piece into its pages. A failed piece fails the room as a whole handoff's does,
and the pieces already landed are discarded with it (``pulls.py``).
"""

from __future__ import annotations

from functools import partial
from typing import TYPE_CHECKING, Any

from fsm_pd.effects import EffectError
from fsm_pd.effects.checksums import read_trailer
from fsm_pd.effects.chunked import ChunkPiece, ChunkPlan, Trailer
from fsm_pd.effects.faults import Corruption, InjectedFault
from fsm_pd.effects.pulls import DecodePart, Pulls, report_pull_error
from fsm_pd.transport.reshard import piece_uuid, plan_between

if TYPE_CHECKING:
    from fsm_pd.effects import Node
    from fsm_pd.machines import Room


class ChunkPull(DecodePart):
    """``DecodeEffects``'s pull of a chunked handoff (a mixin: the handler holds the ports and the book)."""

    def _pull_chunks(self, node: Node, room: Room, pages: list[int]) -> None:
        ctx, room_id = room.ctx, room.room
        layers = int(self.layout["num_layers"]) if ctx.get("chunk_checksums") else 0  # what the trailer holds
        plan = ChunkPlan.of(pages, int(ctx["chunk_pages"]), checksum_layers=layers)
        if len(plan.pieces) != int(ctx["chunks"]) or not plan_between(ctx["peer_layout"], self.layout).unsharded:
            raise EffectError(f"READY announces {ctx['chunks']} pieces of {ctx['chunk_pages']} pages; we wait for "
                              f"{len(pages)} pages in {len(plan.pieces)}", blame="remote")
        pulls = Pulls(plan, trailer=True)
        self.book.start(room_id, pulls)
        self.faults.crash("before_pull")
        where = (ctx["transfer_addr"], int(ctx["uuid"]), float(ctx["deadlines"]["transfer"]))
        self._pull_piece(node, room_id, pulls, where, plan.pieces[0])

    def _pull_piece(self, node: Node, room_id: int, pulls: Pulls, where: tuple, piece: ChunkPiece | Trailer) -> None:
        address, uuid, timeout_s = where
        trailer = isinstance(piece, Trailer)
        corruption = None if trailer else self.faults.corrupting()
        done = partial(self._chunk_pulled, node, room_id, pulls, where, piece, corruption)
        try:
            self.faults.check("pull")
        except InjectedFault as exc:
            done(None, exc)
            return
        self.puller.pull(address, piece_uuid(uuid, piece.index), 0 if trailer else len(piece.pages), timeout_s,
                         done=done, delay_s=self.faults.pull_delay_s, piece=piece if trailer else None)

    def _chunk_pulled(self, node: Node, room_id: int, pulls: Pulls, where: tuple, piece: ChunkPiece | Trailer,
                      corruption: Corruption | None, staging: Any, error: BaseException | None) -> None:
        """One piece of a chunked handoff landed (or failed), on whatever thread the pull port reports from."""
        trailer = isinstance(piece, Trailer)
        if error is None and corruption is not None:
            staging = corruption.landed(staging, self.kv.corrupt)
        plan: ChunkPlan = pulls.plan
        value = staging
        if error is None and trailer:  # the trailer is read here (first token, checksums), its array let go at once
            try:
                value = read_trailer(self.kv.read_trailer(staging), plan.checksum_layers)
            except Exception as exc:  # noqa: BLE001 - a trailer we cannot read fails the pull, not the thread
                error = exc
            finally:
                self.kv.discard(staging)
        if error is not None:
            for array in self.book.fail(room_id, pulls) or ():
                self.kv.discard(array)
            report_pull_error(node, room_id, f"{piece.describe()}: ", error)
            return
        complete = self.book.land(room_id, pulls, piece.index, value)
        if complete is None:  # FreePages already ran: nobody will ever scatter this
            if not trailer:
                self.kv.discard(staging)
            return
        if not complete:  # pieces land in order: the trailer completes the pull
            # progress: the room's transfer deadline starts again (the prefill node computes the next chunks)
            node.submit(room_id, "piece_pulled", {"piece": piece.index})
            after = plan.pieces[piece.index + 1] if piece.index + 1 < len(plan.pieces) else plan.trailer
            self._pull_piece(node, room_id, pulls, where, after)
            return
        self.faults.crash("after_pull")
        arrays = pulls.arrays()
        first_token, checksums = pulls.trailer
        payload = {"bytes": sum(int(a.nbytes) for a in arrays), "chunks": [int(a.nbytes) for a in arrays],
                   "first_token": first_token}
        if checksums is not None:  # journaled, as READY's are for a whole handoff: Scatter compares them
            payload["kv_checksum"] = checksums
        node.submit(room_id, "pulled", payload)
