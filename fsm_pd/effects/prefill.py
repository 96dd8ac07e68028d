"""Effect handlers of the prefill node (sender): gather and publish, READY/ABORT, release the staging buffer.

They reach the world only through ports (``ports.py``): the model executor and the pool operations for the gather,
the transfer backend's publish half, the side channel. ``KVManager`` gives them the real ports, ``fsm_pd.sim`` the
simulated ones, so the simulation runs this code.

When the decode node splits its pool over another number of devices (its layout comes in PREPARE), the gathered
staging is cut into the pieces of the resharding plan (``transport/reshard.py``), and each piece is published under
its own uuid (``piece_uuid``). The room is still one transfer: one ``published`` event, one READY, and its
``ReleaseStaging`` ends every piece's hold, released on success or failed with the room's reason.

A prompt prefilled in chunks is handed over piece by piece while its later chunks compute (``chunked.py``): the
first chunk's ``kv_ready`` publishes what is final and reports ``published`` (READY goes out), every ``kv_chunk``
publishes the pieces that became final since, and the last one also the trailer with the first token. The pieces
and the trailer share the room's uuid as a resharding plan's pieces do, so ``ReleaseStaging`` ends them the same way.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from concurrent.futures import Future
from functools import partial
from typing import TYPE_CHECKING, Any

from fsm_pd.effects import EffectError, EffectInterpreter
from fsm_pd.effects.checksums import DEFAULT_ALGORITHM, trailer_words
from fsm_pd.effects.chunked import ChunkPlan, streams
from fsm_pd.effects.outbox import Outbox
from fsm_pd.effects.ports import run_kv_job
from fsm_pd.machines.effect_types import GatherAndPublish, ReleaseStaging, Send
from fsm_pd.transport.messages import Abort, Ready
from fsm_pd.transport.reshard import piece_uuid, plan_between

if TYPE_CHECKING:
    from fsm_pd.effects import Node
    from fsm_pd.effects.faults import Faults
    from fsm_pd.effects.ports import ModelExecutor, PrefillKV, PublishPort, SideChannelPort
    from fsm_pd.machines import Room

log = logging.getLogger(__name__)


class PrefillEffects:
    def __init__(self, *, layout: dict, channel: SideChannelPort, transfer: PublishPort, model: ModelExecutor,
                 kv: PrefillKV, faults: Faults, new_uuid: Callable[[], int], kv_checksum: bool = True):
        """``kv_checksum``: compute the KV checksum of every handoff and send it (``checksums.py``)."""
        self.layout = dict(layout)
        self.kv_checksum = kv_checksum
        self.channel, self.transfer, self.model, self.kv = channel, transfer, model, kv
        self.faults, self.new_uuid = faults, new_uuid
        # room -> (uuid, pieces) of a staging buffer being gathered or published: its pieces are published under
        # piece_uuid(uuid, 0 .. pieces - 1)
        self.staging: dict[int, tuple[int, int]] = {}
        # room -> [entries of its chunked handoff published so far]: the list is the loop thread's (created, dropped),
        # the count in it the model thread's (the publish jobs, in order)
        self.chunks_sent: dict[int, list[int]] = {}
        # room -> the checksum of each piece of its chunked handoff, filled by the publish jobs (model thread)
        self.chunk_sums: dict[int, list] = {}
        self.outbox = Outbox(channel, faults, peer="decode node", best_effort=frozenset({"ABORT"}),
                             crash_after={"READY": "after_ready"})

    def interpreter(self) -> EffectInterpreter:
        return EffectInterpreter({GatherAndPublish: self.gather_and_publish, ReleaseStaging: self.release_staging,
                                  Send: self.send})

    def gather_and_publish(self, node: Node, room: Room, effect: GatherAndPublish) -> None:
        self.faults.crash("before_gather")
        if room.ctx.get("piece_pages"):  # prefilled in chunks: this is one of its chunks
            pages = pages_to_send(room.ctx)
            if streams(room.ctx, pages, plan_between(self.layout, room.ctx["peer_layout"]).unsharded):
                self._publish_chunks(node, room, pages)
                return
            if not room.ctx.get("last"):
                return  # nothing to stream (one piece, or a resharded handoff): the last chunk hands over the whole
        if room.room in self.staging:
            return  # this room's handoff is under way: a stray kv_chunk on a room handed over whole starts no other
        uuid, pages, room_id = self.new_uuid(), pages_to_send(room.ctx), room.room
        hold_s = float(room.ctx["deadlines"]["pull_hold"])
        if not pages:  # the decode node's prefix cache holds the whole prompt: READY alone, nothing to pull
            self._published(node, room_id, 0, 0)
            return
        plan = plan_between(self.layout, room.ctx["peer_layout"])
        # one piece on a progressive backend: the checksum follows the data as one more entry, so that it can be
        # computed while the data streams (checksum_later) instead of before READY
        check = self.checks(room.ctx)
        entry = check and plan.unsharded and self.transfer.progressive
        self.staging[room_id] = (uuid, len(plan.pieces) + int(entry))
        announce = {"checksum_entry": 1} if entry else {}

        def gather(owner: Any) -> None:
            if self.staging.get(room_id, (None,))[0] != uuid:
                return  # the room ended while this waited for the model thread
            self.faults.check("gather")
            progressive = plan.unsharded and self.transfer.progressive and self.kv.gathers_progressively(owner)
            # the KV is final now and nothing has read it yet: what D must find in its pages, whatever the send
            # reads later (a page freed and reused mid-send) or the wire does to it. Computed here, or (sending as
            # it gathers) by checksum_later under a lease turn this job reserves: either way before any other job
            sums = self.kv.sent_checksum(owner, pages, plan) if check and not progressive else None
            if progressive:
                self.faults.check("publish")
                self.kv.publish_while_gathering(owner, self.transfer, uuid, pages, hold_s,
                                                lambda rows: self._published(node, room_id, uuid, rows, **announce))
                if entry:
                    self.kv.checksum_later(owner, pages, plan, partial(self._publish_sums, node, room_id, uuid, hold_s))
                self.faults.crash("after_gather")
                return
            pieces = self.kv.gather(owner, pages, plan)
            if self.staging.get(room_id, (None,))[0] != uuid:
                for piece in pieces:
                    self.kv.discard(piece)  # the room ended while we gathered
                return
            self.faults.crash("after_gather")
            for index, (piece, staging) in enumerate(zip(plan.pieces, pieces, strict=True)):
                try:
                    self.faults.check("publish")
                    self.transfer.publish(piece_uuid(uuid, index), (staging,), hold_s)
                except BaseException as exc:
                    for unpublished in pieces[index:]:
                        self.kv.discard(unpublished)  # never published: nobody else will let them go
                    if plan.unsharded:
                        raise
                    raise EffectError(f"{piece.describe()}: {exc}") from exc
            if entry:
                self._publish_sums(node, room_id, uuid, hold_s, sums)
            self._published(node, room_id, uuid, int(pieces[0].shape[1]), len(pieces), sums=None if entry else sums,
                            **announce)

        def failed(done: Future) -> None:
            exc = done.exception()
            if exc is not None:  # the room fails; its ReleaseStaging then fails the entry if it was published
                node.submit(room_id, "error", {"blame": "local", "reason": f"gather/publish failed: {exc}"})

        run_kv_job(self.model, self.kv, gather).add_done_callback(failed)

    def checks(self, ctx: dict) -> bool:
        """Whether this room's KV is checksummed: our --kv-checksum, the decode node's (PREPARE says it), and a
        pool we can sum (not on an accelerator: then nothing is announced or published, and D counts it missing)."""
        return self.kv_checksum and ctx.get("peer_kv_checksum", True) and self.kv.summed

    def _publish_sums(self, node: Node, room_id: int, uuid: int, hold_s: float, sums: list | None) -> None:
        """A whole handoff's checksum as the entry after its one piece (``piece_uuid(uuid, 1)``), in a trailer's
        words; from the model thread or a thread of checksum_later's (the send's, or its helper)."""
        if self.staging.get(room_id, (None,))[0] != uuid:
            return  # the room ended: ReleaseStaging failed this entry too
        layers = int(self.layout["num_layers"])
        words = trailer_words(0, [None if sums is None else sums[0]], layers)
        try:
            self.transfer.publish(piece_uuid(uuid, 1), (self.kv.trailer(words),), hold_s)
        except Exception as exc:  # noqa: BLE001 - the room fails rather than leave the pull of this entry waiting
            if self.staging.get(room_id, (None,))[0] == uuid:
                node.submit(room_id, "error", {"blame": "local", "reason": f"gather/publish failed: checksum: {exc}"})

    def _publish_chunks(self, node: Node, room: Room, pages: list[int]) -> None:
        """Publish the pieces of a chunked handoff that are final now (and the trailer after the last chunk); the
        first call also announces the transfer (``published``: READY)."""
        ctx, room_id = room.ctx, room.room
        layers = int(self.layout["num_layers"]) if self.checks(ctx) else 0  # checksums in the trailer
        plan = ChunkPlan.of(pages, int(ctx["piece_pages"]), skipped=int(ctx.get("peer_cached_pages", 0)),
                            checksum_layers=layers)
        last, hold_s = bool(ctx.get("last")), float(ctx["deadlines"]["pull_hold"])
        ready = len(plan.pieces) if last else plan.final(int(ctx.get("final_pages", 0)))
        first_token = int(ctx.get("first_token", 0))
        entry = self.staging.get(room_id)
        announce = entry is None
        if announce:
            uuid = self.new_uuid()
            self.staging[room_id] = (uuid, plan.entries)
            self.chunks_sent[room_id] = [0]
            self.chunk_sums[room_id] = [None] * len(plan.pieces)
        else:
            uuid = entry[0]
        sent, sums = self.chunks_sent[room_id], self.chunk_sums[room_id]
        reshard = plan_between(self.layout, ctx["peer_layout"])

        def publish(owner: Any) -> None:
            if self.staging.get(room_id, (None,))[0] != uuid or sent[0] < 0:
                return  # the room ended while this waited for the model thread, or an earlier piece failed
            for piece in plan.pieces[sent[0]:ready]:
                sent[0] = -1  # until it is published: a failed piece is never retried by a later chunk's job
                self.faults.check("gather")
                if layers:  # this piece's pages hold final KV now
                    sums[piece.index] = (self.kv.sent_checksum(owner, list(piece.pages), reshard) or [None])[0]
                (staging,) = self.kv.gather(owner, list(piece.pages), reshard)
                try:
                    self.faults.check("publish")
                    self.transfer.publish(piece_uuid(uuid, piece.index), (staging,), hold_s)
                except BaseException as exc:
                    self.kv.discard(staging)
                    raise EffectError(f"{piece.describe()}: {exc}") from exc
                sent[0] = piece.index + 1
            if last and sent[0] == len(plan.pieces):
                self.faults.check("publish")
                words = trailer_words(first_token, sums if layers else None, layers)
                self.transfer.publish(piece_uuid(uuid, plan.trailer.index), (self.kv.trailer(words),), hold_s)
                sent[0] = plan.entries

        if announce:
            self._published(node, room_id, uuid, 0, chunks=len(plan.pieces), chunk_pages=int(ctx["piece_pages"]),
                            chunk_checksums=int(bool(layers)))
        self.model.submit(publish).add_done_callback(partial(self._failed, node, room_id))

    def _failed(self, node: Node, room_id: int, done: Future) -> None:
        exc = done.exception()
        if exc is not None:  # the room fails; its ReleaseStaging then fails every entry, published or not
            node.submit(room_id, "error", {"blame": "local", "reason": f"gather/publish failed: {exc}"})

    def _published(self, node: Node, room_id: int, uuid: int, rows: int, pieces: int = 1,
                   sums: list[list[int]] | None = None, **chunked: int) -> None:
        self.faults.crash("after_publish")
        payload = {"uuid": uuid, "transfer_addr": self.transfer.address, "rows": int(rows), **chunked}
        if sums is not None or chunked.get("checksum_entry") or chunked.get("chunk_checksums"):
            payload["kv_checksum_algorithm"] = self.kv.checksum_algorithm  # journaled: READY names it
        if sums is not None:  # journaled: READY carries it (one crc32c per piece and layer)
            payload["kv_checksum"] = sums
        if pieces > 1:  # journaled: how many pieces (uuids from piece_uuid(uuid, 0)) the decode node pulls
            payload["pieces"] = pieces
        node.submit(room_id, "published", payload)

    def release_staging(self, node: Node, room: Room, effect: ReleaseStaging) -> None:
        entry = self.staging.pop(room.room, None)
        self.chunks_sent.pop(room.room, None)
        self.chunk_sums.pop(room.room, None)
        if entry is None:
            return
        uuid, pieces = entry
        if room.state == "Success":
            self.faults.crash("after_pulled")
            for index in range(pieces):
                self.transfer.release(piece_uuid(uuid, index))
        else:  # late pullers get an error at once instead of waiting for a buffer that is gone
            for index in range(pieces):
                self.transfer.fail(piece_uuid(uuid, index), room.reason or "transfer failed")

    def send(self, node: Node, room: Room, effect: Send) -> None:
        ctx, channel = room.ctx, self.channel
        if effect.kind == "READY":
            msg = channel.stamp(Ready, room=room.room, transfer_id=ctx["transfer_id"], uuid=ctx["uuid"],
                                transfer_addr=ctx["transfer_addr"], backend=self.transfer.name, layout=self.layout,
                                page_count=len(pages_to_send(ctx)), first_token=ctx.get("first_token", 0),
                                first_logprob=ctx.get("first_logprob"), input_logprobs=ctx.get("input_logprobs"),
                                top_logprobs=ctx.get("top_logprobs"), cached_tokens=ctx.get("cached_tokens", 0),
                                chunks=ctx.get("chunks", 0), chunk_pages=ctx.get("chunk_pages", 0),
                                kv_checksum=ctx.get("kv_checksum"), chunk_checksums=bool(ctx.get("chunk_checksums")),
                                checksum_entry=bool(ctx.get("checksum_entry")),
                                kv_checksum_algorithm=ctx.get("kv_checksum_algorithm", DEFAULT_ALGORITHM))
        elif effect.kind == "ABORT":
            msg = channel.stamp(Abort, room=room.room, reason=room.reason or "aborted")
        else:
            raise EffectError(f"the prefill node does not send {effect.kind}")
        self.outbox.send(node, room.room, ctx["reply_to"], msg, effect.kind)

    def held(self) -> int:
        return len(self.staging)


def pages_to_send(ctx: dict) -> list[int]:
    """The room's pages the decode node lacks: all of them, but the leading ones its prefix cache holds."""
    return list(ctx["pages"])[int(ctx.get("peer_cached_pages", 0)):]
