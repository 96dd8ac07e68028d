"""Effect handlers of the decode node (receiver): resolve, admit, PREPARE, pull and verify, scatter, free.

They reach the world only through ports (``ports.py``). Lookups and pulls block, so their ports run them elsewhere
and report back; every pool access (scatter, and freeing pages a queued scatter may still write) is a job on the model
executor, in order.

``DecodeEffects`` is assembled from one module per idea: the pulls in flight and who owns a pulled buffer
(``pulls.py``), the pull of a whole handoff with its resharding pieces, streamed scatter and checksum entry
(``room_pull.py``), the pull of a chunked handoff (``chunk_pull.py``), and the scatter with its checksum comparison
(``scatter.py``). This module holds the rest: the lookups, admission, the messages to the prefill node and the frees.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from fsm_pd.effects import EffectError, EffectInterpreter
from fsm_pd.effects.chunk_pull import ChunkPull
from fsm_pd.effects.outbox import Outbox
from fsm_pd.effects.pulls import PullBook, pages_to_receive
from fsm_pd.effects.room_pull import RoomPull
from fsm_pd.effects.scatter import ScatterAndVerify
from fsm_pd.machines.effect_types import FreePages, Pull, ReservePages, ResolveBootstrap, Scatter, Send
from fsm_pd.transport.messages import Abort, Prepare, Pulled

if TYPE_CHECKING:
    from collections.abc import Callable

    from fsm_pd.effects import Node
    from fsm_pd.effects.faults import Faults
    from fsm_pd.effects.ports import Admission, DecodeKV, ModelExecutor, PullPort, ResolverPort, SideChannelPort
    from fsm_pd.machines import Room

__all__ = ["RECOMPUTE_NOTE", "DecodeEffects", "pages_to_receive"]

# Appended to an ABORT's reason when the decode node takes the request over and prefills it itself (the decode
# engine's ``--on-transfer-failure recompute``): the prefill node then answers its leg instead of failing it.
RECOMPUTE_NOTE = " [the decode node recomputes this request]"


class DecodeEffects(RoomPull, ChunkPull, ScatterAndVerify):
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
        self.book = PullBook()
        self.outbox = Outbox(channel, faults, peer="prefill node", best_effort=frozenset({"ABORT", "PULLED"}),
                             crash_after={"PREPARE": "after_prepare"})

    @property
    def pending(self) -> dict[int, Any]:
        """Rooms whose pull has not reported yet."""
        return self.book.pending

    @property
    def pulled(self) -> dict[int, tuple | None]:
        """Room -> its verified pieces, waiting for Scatter."""
        return self.book.pulled

    @property
    def streams(self) -> dict[int, Any]:
        """Room -> the layers written while its pull is in flight."""
        return self.book.streams

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
            self.book.nothing_to_pull(room_id)
            node.submit(room_id, "pulled", {"bytes": 0})
        elif ctx.get("chunks"):
            self._pull_chunks(node, room, pages)
        else:
            self._pull_room(node, room, pages)

    def free_pages(self, node: Node, room: Room, effect: FreePages) -> None:
        room_id = room.room
        arrays, stream = self.book.drop(room_id)  # a piece still in flight discards its result itself
        for array in arrays:
            self.kv.discard(array)

        def free(owner: Any) -> None:  # on the model thread: after any write still queued for these pages
            if stream is not None:
                self.kv.cancel(stream)  # and writes queued later (a pull still landing layers) find it cancelled
            self.admission.release(node, room_id)

        self.model.submit(free)

    def finish(self, node: Node, room: int) -> None:
        """The request finished decoding: free its pages (on the model thread, after any queued write)."""
        self.model.submit(lambda owner: self.admission.release(node, room))
