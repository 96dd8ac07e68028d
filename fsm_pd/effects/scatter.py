"""The decode node's ``Scatter``: write a room's verified pulled arrays into its pages, then check their checksum.

A pulled buffer is scattered only after the backend verified it (ready, error-free, shaped as our layout says), and
only when the machine asks for it with ``Scatter``. The write is a job on the model executor, in order with every other
pool access; a streamed pull (``room_pull.py``) has written most of it already, and the job only waits for the last
writes. In the same job, after the last write, the pages' checksum is compared with the one P sent (``checksums.py``):
a mismatch fails the room with its own reason, which the decode engine answers by recomputing the request.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from fsm_pd.effects.checksums import (
    DEFAULT_ALGORITHM,
    MISSING,
    OFF,
    OTHER_ALGORITHM,
    UNCHECKED,
    VERIFIED,
    ChecksumMismatch,
    mismatch,
)
from fsm_pd.effects.chunked import ChunkPlan
from fsm_pd.effects.ports import run_kv_job
from fsm_pd.effects.pulls import DecodePart, pages_to_receive
from fsm_pd.transport.reshard import ReshardPlan, plan_between

if TYPE_CHECKING:
    from fsm_pd.effects import Node
    from fsm_pd.machines import Room
    from fsm_pd.machines.effect_types import Scatter

log = logging.getLogger(__name__)


class ScatterAndVerify(DecodePart):
    """``DecodeEffects``'s ``Scatter`` (a mixin: the handler holds the ports and the book)."""

    def scatter(self, node: Node, room: Room, effect: Scatter) -> None:
        self.faults.crash("before_scatter")
        room_id, pages = room.room, pages_to_receive(room.ctx)
        pieces, stream = self.book.take(room_id)
        if not pages:
            node.submit(room_id, "scattered", {})
            return
        plan = plan_between(room.ctx["peer_layout"], self.layout)
        streamed = stream is not None and self.kv.complete_stream(stream, pieces[0])
        chunks = ChunkPlan.of(pages, int(room.ctx["chunk_pages"])).pieces if room.ctx.get("chunks") else None
        expected = room.ctx.get("kv_checksum") if self.kv_checksum else None
        if self.kv_checksum and expected is None:
            log.info("room %d: no KV checksum from the prefill node (its --kv-checksum is off, or its pool is not "
                     "checksummed): the handoff is not verified", room_id)
        theirs, ours = room.ctx.get("kv_checksum_algorithm", DEFAULT_ALGORITHM), self.kv.checksum_algorithm
        foreign = expected is not None and theirs != ours  # values we cannot compare: neither a pass nor a mismatch
        if foreign:
            log.warning("room %d: the prefill node's KV checksum is %s, ours %s: the handoff is not verified",
                        room_id, theirs, ours)

        def write(owner: Any) -> tuple[str, list[int] | None]:
            adopted = None  # a shared pool's handoff: the pages adopted instead of written (control/pool_kv.py)
            try:
                self.faults.check("scatter")
                if chunks is None:
                    adopted = self.kv.scatter(owner, pieces, pages, stream if streamed else None, plan)
                else:  # a chunked handoff: piece by piece
                    for piece, staging in zip(chunks, pieces, strict=True):
                        self.kv.scatter(owner, (staging,), list(piece.pages), None, plan)
            finally:
                for piece in pieces:
                    self.kv.discard(piece)
            if foreign:
                return OTHER_ALGORITHM, adopted
            return self._verify(owner, pages, plan, chunks, expected, stream if streamed else None), adopted

        def done(future) -> None:
            exc = future.exception()
            if exc is None:
                self.faults.crash("after_scatter")
                check, adopted = future.result()
                payload: dict[str, Any] = {"kv_checksum_check": check}
                if adopted is not None:  # journaled: the room's pages are now these, and no byte was written
                    kept = list(room.ctx["pages"])[:len(room.ctx["pages"]) - len(pages)]  # our cached prefix
                    payload.update(pages=kept + adopted, adopted_pages=len(adopted), bytes=0)
                node.submit(room_id, "scattered", payload)
            elif isinstance(exc, ChecksumMismatch):  # its own reason; the decode engine recomputes the request
                node.submit(room_id, "error", {"blame": "remote", "reason": str(exc)})
            else:
                node.submit(room_id, "error", {"blame": "local", "reason": f"scatter failed: {exc}"})

        run_kv_job(self.model, self.kv, write).add_done_callback(done)

    def _verify(self, owner: Any, pages: list[int], plan: ReshardPlan, chunks: tuple | None,
                expected: list | None, stream: Any = None) -> str:
        """Model thread, in the job of the handoff's last write, so after every write into ``pages``: compare their
        checksum with P's; raises ``ChecksumMismatch``, else says what was checked (``checksums.OUTCOMES``)."""
        if not self.kv_checksum:
            return OFF
        if expected is None:
            return MISSING
        if chunks is None:  # a streamed write may have taken it as it wrote (overlapped with the wire)
            got = None if stream is None else stream.checksums(owner)
            got = got if got is not None else self.kv.received_checksum(owner, pages, plan)
        else:  # one checksum per chunk piece, over its pages
            got = [self.kv.received_checksum(owner, list(piece.pages), plan) for piece in chunks]
            got = None if any(part is None for part in got) else [part[0] for part in got]
        if got is None:
            return UNCHECKED
        wrong = mismatch(expected, got, "piece" if chunks is None else "chunk piece")
        if wrong is not None:
            raise ChecksumMismatch(wrong)
        return VERIFIED
