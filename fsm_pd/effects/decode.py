"""Effect handlers of the decode node (receiver): resolve, admit, PREPARE, pull and verify, scatter, free.

They reach the world only through ports (``ports.py``). Lookups and pulls block, so their ports run them elsewhere
and report back; every pool access (scatter, and freeing pages a queued scatter may still write) is a job on the model
executor, in order. A pulled buffer is scattered only after the backend verified it (ready, error-free, shaped as our
layout says), and only when the machine asks for it with ``Scatter``.

Who owns a pulled buffer. A pull is *pending* from ``Pull`` until its result arrives. If the room is still pending
then, the buffer goes to ``pulled`` until ``Scatter`` takes it (and discards it once written); if ``FreePages`` ran
first (the room failed while the pull was in flight), the late result is discarded at once. One lock orders the two,
so every pulled buffer is discarded exactly once, whichever comes first.

With a progressive backend and a pool on one CPU device, the scatter starts during the pull instead: each group of
layers is written as soon as it has landed (``StreamedScatter``), and ``Scatter`` only waits for the last writes.
A layer is final when it lands, and P's layout was checked before the first byte was accepted; what the pull can
still fail on is the rest of the stream, and then the room fails and its pages (some already written) are freed
behind every queued write, which finds the stream cancelled.

Different tensor-parallel sizes on P and D. The room is still one transfer: one ``Pull`` effect, one ``pulled`` or
``error`` event. Its plan (``transport/reshard.py``, from P's layout in READY and ours) has one piece per run of KV
slots a decode shard needs from a prefill shard, and the handler pulls every piece (its own uuid, ``piece_uuid``).
The room's pull is pending until every piece landed (``pulled`` then carries all of them, in plan order, to
``Scatter``, which assembles and writes them) or until the first piece fails: that error fails the room and names
the piece and both shards; pieces that land later find no pending pull and are discarded at once.

A chunked handoff (READY with ``chunks``: ``chunked.py``) is pulled piece after piece, each parked on the prefill node
until its chunk is computed, then the trailer; ``pulled`` (with the first token from the trailer) reports once the
trailer landed, and ``Scatter`` writes every piece into its pages. A failed piece fails the room as above, and the
pieces already landed are discarded with it.
"""

from __future__ import annotations

import logging
import threading
from functools import partial
from typing import TYPE_CHECKING, Any

from fsm_pd.effects import EffectError, EffectInterpreter
from fsm_pd.effects.checksums import MISSING, OFF, UNCHECKED, VERIFIED, ChecksumMismatch, mismatch, read_trailer
from fsm_pd.effects.chunked import TRAILER_WORDS, ChunkPiece, ChunkPlan, ChunkPulls, Trailer
from fsm_pd.effects.faults import InjectedFault
from fsm_pd.effects.outbox import Outbox
from fsm_pd.machines.effect_types import FreePages, Pull, ReservePages, ResolveBootstrap, Scatter, Send
from fsm_pd.transport.backends.base import TransferFailed, TransferTimeout
from fsm_pd.transport.messages import Abort, Prepare, Pulled
from fsm_pd.transport.reshard import Piece, ReshardPlan, piece_uuid, plan_between

if TYPE_CHECKING:
    from collections.abc import Callable

    from fsm_pd.effects import Node
    from fsm_pd.effects.faults import Faults
    from fsm_pd.effects.ports import Admission, DecodeKV, ModelExecutor, PullPort, ResolverPort, SideChannelPort
    from fsm_pd.machines import Room

log = logging.getLogger(__name__)

# Appended to an ABORT's reason when the decode node takes the request over and prefills it itself (the decode
# engine's ``--on-transfer-failure recompute``): the prefill node then answers its leg instead of failing it.
RECOMPUTE_NOTE = " [the decode node recomputes this request]"


class RoomPulls:
    """The pulls of one room, one per piece of its plan (and its checksum entry, if P sends one); complete when
    every piece has landed."""

    def __init__(self, plan: ReshardPlan, checksum_entry: bool = False):
        self.plan = plan
        self.landed: dict[int, Any] = {}  # piece index -> its verified array
        self.waits_for_sums = checksum_entry
        self.sums: list[list[int]] | None = None  # from the checksum entry

    def land(self, piece: Piece, staging: Any) -> bool:
        self.landed[piece.index] = staging
        return self.complete

    def land_sums(self, sums: list[list[int]] | None) -> bool:
        self.sums, self.waits_for_sums = sums, False
        return self.complete

    @property
    def complete(self) -> bool:
        return len(self.landed) == len(self.plan.pieces) and not self.waits_for_sums

    def arrays(self) -> tuple:
        return tuple(self.landed[piece.index] for piece in self.plan.pieces)


class DecodeEffects:
    # set by a decode engine that recomputes failed transfers: True for a failed room it will recompute
    abort_note: Callable[[Room], bool] | None = None

    def __init__(self, *, layout: dict, channel: SideChannelPort, resolver: ResolverPort, admission: Admission,
                 puller: PullPort, model: ModelExecutor, kv: DecodeKV, faults: Faults, kv_checksum: bool = True):
        """``kv_checksum``: verify the KV checksum P sent against our pages before the request decodes
        (``checksums.py``)."""
        self.layout = dict(layout)
        self.kv_checksum = kv_checksum
        self.channel, self.resolver, self.admission = channel, resolver, admission
        self.puller, self.model, self.kv, self.faults = puller, model, kv, faults
        self._lock = threading.Lock()  # orders a pull's result against FreePages (see the module docstring)
        self.pending: dict[int, RoomPulls] = {}  # rooms whose pull has not reported yet
        self.pulled: dict[int, tuple] = {}  # room -> its verified pieces, waiting for Scatter
        self.streams: dict[int, Any] = {}  # room -> layers written while its pull is in flight
        self.outbox = Outbox(channel, faults, peer="prefill node", best_effort=frozenset({"ABORT", "PULLED"}),
                             crash_after={"PREPARE": "after_prepare"})

    def interpreter(self) -> EffectInterpreter:
        return EffectInterpreter({ResolveBootstrap: self.resolve_bootstrap, ReservePages: self.reserve_pages,
                                  Send: self.send, Pull: self.pull, Scatter: self.scatter,
                                  FreePages: self.free_pages})

    def resolve_bootstrap(self, node: Node, room: Room, effect: ResolveBootstrap) -> None:
        room_id = room.room

        def resolved(found: dict | None, error: BaseException | None) -> None:
            if error is not None:  # a lookup failure is the peer's side's fault
                node.submit(room_id, "error", {"blame": "remote", "reason": f"bootstrap lookup failed: {error}"})
            else:
                node.submit(room_id, "bootstrap_resolved", found)

        self.resolver.resolve(room.ctx, resolved)

    def reserve_pages(self, node: Node, room: Room, effect: ReservePages) -> None:
        self.admission.request(node, room.room, room.ctx.get("page_count"))

    def send(self, node: Node, room: Room, effect: Send) -> None:
        ctx, channel = room.ctx, self.channel
        if effect.kind == "PREPARE":
            msg = channel.stamp(Prepare, room=room.room, transfer_id=room.room, reply_to=channel.address,
                                layout=self.layout, page_count=len(ctx["pages"]),
                                prompt_len=int(ctx.get("prompt_len", 0)), cached_pages=int(ctx.get("cached_pages", 0)),
                                kv_checksum=self.kv_checksum)
        elif effect.kind == "PULLED":
            msg = channel.stamp(Pulled, room=room.room, transfer_id=room.room)
        elif effect.kind == "ABORT":
            reason = room.reason or "aborted"
            if self.abort_note is not None and self.abort_note(room):
                reason += RECOMPUTE_NOTE
            msg = channel.stamp(Abort, room=room.room, reason=reason)
        else:
            raise EffectError(f"the decode node does not send {effect.kind}")
        self.outbox.send(node, room.room, ctx["prefill_addr"], msg, effect.kind)

    def pull(self, node: Node, room: Room, effect: Pull) -> None:
        ctx, room_id = room.ctx, room.room
        pages = pages_to_receive(ctx)
        if int(ctx["page_count"]) != len(pages):
            raise EffectError(f"READY announces {ctx['page_count']} pages, we wait for {len(pages)}",
                              blame="remote")
        if not pages:  # our prefix cache holds the whole prompt: nothing moves
            with self._lock:
                self.pulled[room_id] = None
            node.submit(room_id, "pulled", {"bytes": 0})
            return
        if ctx.get("chunks"):
            self._pull_chunks(node, room, pages)
            return
        plan = plan_between(ctx["peer_layout"], self.layout)
        stream = self.kv.stream(pages) if plan.unsharded else None
        entry = bool(ctx.get("checksum_entry")) and plan.unsharded
        with self._lock:
            self.pending[room_id] = RoomPulls(plan, entry)
            if stream is not None:  # registered before the pull starts, so that FreePages can always cancel it
                self.streams[room_id] = stream
        self.faults.crash("before_pull")
        for piece in plan.pieces:
            try:
                self.faults.check("pull")
            except InjectedFault as exc:
                self._pulled(node, room_id, plan, piece, None, exc)
                return
            done = partial(self._pulled, node, room_id, plan, piece)
            self.puller.pull(ctx["transfer_addr"], piece_uuid(int(ctx["uuid"]), piece.index), len(pages),
                             float(ctx["deadlines"]["transfer"]), done=done,
                             on_progress=self.faults.corrupting(None if stream is None else stream.on_progress),
                             delay_s=self.faults.pull_delay_s, piece=piece)
        if entry:  # the checksum, published once P has computed it (meanwhile the pull waits on P, like a chunk's)
            layers = int(self.layout["num_layers"])
            trailer = Trailer(len(plan.pieces), TRAILER_WORDS + 1 + layers)
            self.puller.pull(ctx["transfer_addr"], piece_uuid(int(ctx["uuid"]), trailer.index), 0,
                             float(ctx["deadlines"]["transfer"]), done=partial(self._sums_pulled, node, room_id, plan),
                             piece=trailer)

    def _sums_pulled(self, node: Node, room_id: int, plan: ReshardPlan, staging: Any,
                     error: BaseException | None) -> None:
        """The checksum entry of a whole handoff landed (or failed), on whatever thread the pull port reports from."""
        sums = None
        if error is None:
            try:
                _, sums = read_trailer(self.kv.read_trailer(staging), int(self.layout["num_layers"]))
            except Exception as exc:  # noqa: BLE001 - an entry we cannot read fails the pull, not the thread
                error = exc
            finally:
                self.kv.discard(staging)
        with self._lock:
            pulls = self.pending.get(room_id)
            if pulls is None:
                return  # FreePages already ran, or a piece failed: that is the room's story
            if error is not None:
                del self.pending[room_id]
            elif pulls.land_sums(sums):
                del self.pending[room_id]
                self.pulled[room_id] = pulls.arrays()
            else:
                return
        if error is not None:
            for landed in pulls.landed.values():
                self.kv.discard(landed)
            self._report_pull_error(node, room_id, "checksum entry: ", error)
            return
        self._complete(node, room_id, pulls)

    def _pulled(self, node: Node, room_id: int, plan: ReshardPlan, piece: Piece, staging: Any,
                error: BaseException | None) -> None:
        """One piece's result, on whatever thread the pull port reports from."""
        with self._lock:
            pulls = self.pending.get(room_id)
            if error is not None and pulls is not None:  # the first piece to fail fails the room's pull
                del self.pending[room_id]
            complete = error is None and pulls is not None and pulls.land(piece, staging)
            if complete:
                del self.pending[room_id]
                self.pulled[room_id] = pulls.arrays()
        if error is not None:
            if pulls is not None:  # pieces that landed before this one will never be scattered
                for landed in pulls.landed.values():
                    self.kv.discard(landed)
            self._report_pull_error(node, room_id, "" if plan.unsharded else f"{piece.describe()}: ", error)
            return
        if pulls is None:  # FreePages already ran, or another piece failed: nobody will ever scatter this
            self.kv.discard(staging)
            if plan.unsharded:  # journaled as ignored, for replay to show the late pull (a piece's failure shows)
                node.submit(room_id, "pulled", {"bytes": int(staging.nbytes)})
            return
        if complete:
            self._complete(node, room_id, pulls)

    def _complete(self, node: Node, room_id: int, pulls: RoomPulls) -> None:
        """Every piece (and the checksum entry) of a room's pull landed: ``pulled``."""
        self.faults.crash("after_pull")
        arrays = pulls.arrays()
        payload: dict[str, Any] = {"bytes": sum(int(a.nbytes) for a in arrays)}
        if not pulls.plan.unsharded:  # per piece: from which prefill shard, into which decode shard, how many bytes
            payload["pieces"] = [[p.src, p.dst, int(a.nbytes)] for p, a in zip(pulls.plan.pieces, arrays, strict=True)]
        if pulls.sums is not None:  # journaled, as READY's would be: Scatter compares them
            payload["kv_checksum"] = pulls.sums
        node.submit(room_id, "pulled", payload)

    def _pull_chunks(self, node: Node, room: Room, pages: list[int]) -> None:
        ctx, room_id = room.ctx, room.room
        layers = int(self.layout["num_layers"]) if ctx.get("chunk_checksums") else 0  # what the trailer holds
        plan = ChunkPlan.of(pages, int(ctx["chunk_pages"]), checksum_layers=layers)
        if len(plan.pieces) != int(ctx["chunks"]) or not plan_between(ctx["peer_layout"], self.layout).unsharded:
            raise EffectError(f"READY announces {ctx['chunks']} pieces of {ctx['chunk_pages']} pages; we wait for "
                              f"{len(pages)} pages in {len(plan.pieces)}", blame="remote")
        pulls = ChunkPulls(plan)
        with self._lock:
            self.pending[room_id] = pulls
        self.faults.crash("before_pull")
        where = (ctx["transfer_addr"], int(ctx["uuid"]), float(ctx["deadlines"]["transfer"]))
        self._pull_piece(node, room_id, pulls, where, plan.pieces[0])

    def _pull_piece(self, node: Node, room_id: int, pulls: ChunkPulls, where: tuple,
                    piece: ChunkPiece | Trailer) -> None:
        address, uuid, timeout_s = where
        done = partial(self._chunk_pulled, node, room_id, pulls, where, piece)
        try:
            self.faults.check("pull")
        except InjectedFault as exc:
            done(None, exc)
            return
        trailer = isinstance(piece, Trailer)
        self.puller.pull(address, piece_uuid(uuid, piece.index), 0 if trailer else len(piece.pages), timeout_s,
                         done=done, delay_s=self.faults.pull_delay_s,
                         on_progress=None if trailer else self.faults.corrupting(None),
                         piece=piece if trailer else None)

    def _chunk_pulled(self, node: Node, room_id: int, pulls: ChunkPulls, where: tuple, piece: ChunkPiece | Trailer,
                      staging: Any, error: BaseException | None) -> None:
        """One piece of a chunked handoff landed (or failed), on whatever thread the pull port reports from."""
        trailer = isinstance(piece, Trailer)
        if error is None and trailer:
            try:
                pulls.first_token, pulls.checksums = read_trailer(self.kv.read_trailer(staging),
                                                                  pulls.plan.checksum_layers)
            except Exception as exc:  # noqa: BLE001 - a trailer we cannot read fails the pull, not the thread
                error = exc
            finally:
                self.kv.discard(staging)
        with self._lock:
            live = self.pending.get(room_id) is pulls
            if live and (error is not None or trailer):
                del self.pending[room_id]
                if error is None:
                    self.pulled[room_id] = pulls.arrays()
            elif live:
                pulls.land(piece.index, staging)
        if error is not None:
            if live:
                for landed in pulls.landed.values():
                    self.kv.discard(landed)
            self._report_pull_error(node, room_id, f"{piece.describe()}: ", error)
            return
        if not live:  # FreePages already ran: nobody will ever scatter this
            if not trailer:
                self.kv.discard(staging)
            return
        if not trailer:
            plan = pulls.plan
            after = plan.pieces[piece.index + 1] if piece.index + 1 < len(plan.pieces) else plan.trailer
            self._pull_piece(node, room_id, pulls, where, after)
            return
        self.faults.crash("after_pull")
        arrays = pulls.arrays()
        payload = {"bytes": sum(int(a.nbytes) for a in arrays), "chunks": [int(a.nbytes) for a in arrays],
                   "first_token": pulls.first_token}
        if pulls.checksums is not None:  # journaled, as READY's are for a whole handoff: Scatter compares them
            payload["kv_checksum"] = pulls.checksums
        node.submit(room_id, "pulled", payload)

    def _report_pull_error(self, node: Node, room_id: int, which: str, error: BaseException) -> None:
        if isinstance(error, TransferTimeout):
            node.submit(room_id, "error", {"blame": "timeout", "reason": f"pull timed out: {which}{error}"})
        elif isinstance(error, TransferFailed):
            node.submit(room_id, "error", {"blame": error.blame, "reason": f"pull failed: {which}{error.reason}"})
        else:
            node.submit(room_id, "error", {"blame": "local", "reason": f"pull failed: {which}{error}"})

    def scatter(self, node: Node, room: Room, effect: Scatter) -> None:
        self.faults.crash("before_scatter")
        room_id, pages = room.room, pages_to_receive(room.ctx)
        with self._lock:
            pieces, stream = self.pulled.pop(room_id), self.streams.pop(room_id, None)
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

        def write(owner: Any) -> str:
            try:
                self.faults.check("scatter")
                if chunks is None:
                    self.kv.scatter(owner, pieces, pages, stream if streamed else None, plan)
                else:  # a chunked handoff: piece by piece
                    for piece, staging in zip(chunks, pieces, strict=True):
                        self.kv.scatter(owner, (staging,), list(piece.pages), None, plan)
            finally:
                for piece in pieces:
                    self.kv.discard(piece)
            return self._verify(owner, pages, plan, chunks, expected, stream if streamed else None)

        def done(future) -> None:
            exc = future.exception()
            if exc is None:
                self.faults.crash("after_scatter")
                node.submit(room_id, "scattered", {"kv_checksum_check": future.result()})
            elif isinstance(exc, ChecksumMismatch):  # its own reason; the decode engine recomputes the request
                node.submit(room_id, "error", {"blame": "remote", "reason": str(exc)})
            else:
                node.submit(room_id, "error", {"blame": "local", "reason": f"scatter failed: {exc}"})

        self.model.submit(write).add_done_callback(done)

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

    def free_pages(self, node: Node, room: Room, effect: FreePages) -> None:
        room_id = room.room
        with self._lock:
            pulls = self.pending.pop(room_id, None)  # a piece still in flight discards its result itself
            pieces = self.pulled.pop(room_id, None) or (() if pulls is None else tuple(pulls.landed.values()))
            stream = self.streams.pop(room_id, None)
        for piece in pieces:
            self.kv.discard(piece)

        def free(owner: Any) -> None:  # on the model thread: after any write still queued for these pages
            if stream is not None:
                self.kv.cancel(stream)  # and writes queued later (a pull still landing layers) find it cancelled
            self.admission.release(node, room_id)

        self.model.submit(free)

    def finish(self, node: Node, room: int) -> None:
        """The request finished decoding: free its pages (on the model thread, after any queued write)."""
        self.model.submit(lambda owner: self.admission.release(node, room))


def pages_to_receive(ctx: dict) -> list[int]:
    """The room's pages a transfer fills: all of them, but the leading ones our prefix cache already holds."""
    return list(ctx["pages"])[int(ctx.get("cached_pages", 0)):]
