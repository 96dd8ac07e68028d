"""Effect handlers of the prefill node (sender): gather and publish, READY/ABORT, release the staging buffer.

They reach the world only through ports (``ports.py``): the model executor and the pool operations for the gather,
the transfer backend's publish half, the side channel. ``KVManager`` gives them the real ports, ``fsm_pd.sim`` the
simulated ones, so the simulation runs this code.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

from fsm_pd.effects import EffectError, EffectInterpreter
from fsm_pd.effects.outbox import Outbox
from fsm_pd.machines.effects import GatherAndPublish, ReleaseStaging, Send
from fsm_pd.transport.messages import Abort, Ready

if TYPE_CHECKING:
    from fsm_pd.effects import Node
    from fsm_pd.effects.faults import Faults
    from fsm_pd.effects.ports import ModelExecutor, PrefillKV, PublishPort, SideChannelPort
    from fsm_pd.machines import Room

log = logging.getLogger(__name__)


class PrefillEffects:
    def __init__(self, *, layout: dict, channel: SideChannelPort, transfer: PublishPort, model: ModelExecutor,
                 kv: PrefillKV, faults: Faults, new_uuid: Callable[[], int]):
        self.layout = dict(layout)
        self.channel, self.transfer, self.model, self.kv = channel, transfer, model, kv
        self.faults, self.new_uuid = faults, new_uuid
        self.staging: dict[int, int] = {}  # room -> uuid of a staging buffer being gathered or published
        self.outbox = Outbox(channel, faults, peer="decode node", best_effort=frozenset({"ABORT"}),
                             crash_after={"READY": "after_ready"})

    def interpreter(self) -> EffectInterpreter:
        return EffectInterpreter({GatherAndPublish: self.gather_and_publish, ReleaseStaging: self.release_staging,
                                  Send: self.send})

    def gather_and_publish(self, node: Node, room: Room, effect: GatherAndPublish) -> None:
        self.faults.crash("before_gather")
        uuid, pages, room_id = self.new_uuid(), pages_to_send(room.ctx), room.room
        hold_s = float(room.ctx["deadlines"]["pull_hold"])
        if not pages:  # the decode node's prefix cache holds the whole prompt: READY alone, nothing to pull
            self._published(node, room_id, 0, 0)
            return
        self.staging[room_id] = uuid

        def gather(owner: Any) -> None:
            if self.staging.get(room_id) != uuid:
                return  # the room ended while this waited for the model thread
            self.faults.check("gather")
            if self.transfer.progressive and self.kv.gathers_progressively(owner):
                self.faults.check("publish")
                self.kv.publish_while_gathering(owner, self.transfer, uuid, pages, hold_s,
                                                lambda rows: self._published(node, room_id, uuid, rows))
                self.faults.crash("after_gather")
                return
            staging = self.kv.gather(owner, pages)
            if self.staging.get(room_id) != uuid:
                self.kv.discard(staging)  # the room ended while we gathered
                return
            self.faults.crash("after_gather")
            try:
                self.faults.check("publish")
                self.transfer.publish(uuid, (staging,), hold_s)
            except BaseException:
                self.kv.discard(staging)  # never published: nobody else will let it go
                raise
            self._published(node, room_id, uuid, int(staging.shape[1]))

        def failed(done: Future) -> None:
            exc = done.exception()
            if exc is not None:  # the room fails; its ReleaseStaging then fails the entry if it was published
                node.submit(room_id, "error", {"blame": "local", "reason": f"gather/publish failed: {exc}"})

        self.model.submit(gather).add_done_callback(failed)

    def _published(self, node: Node, room_id: int, uuid: int, rows: int) -> None:
        self.faults.crash("after_publish")
        node.submit(room_id, "published", {"uuid": uuid, "transfer_addr": self.transfer.address, "rows": int(rows)})

    def release_staging(self, node: Node, room: Room, effect: ReleaseStaging) -> None:
        uuid = self.staging.pop(room.room, None)
        if uuid is None:
            return
        if room.state == "Success":
            self.faults.crash("after_pulled")
            self.transfer.release(uuid)
        else:  # late pullers get an error at once instead of waiting for a buffer that is gone
            self.transfer.fail(uuid, room.reason or "transfer failed")

    def send(self, node: Node, room: Room, effect: Send) -> None:
        ctx, channel = room.ctx, self.channel
        if effect.kind == "READY":
            msg = channel.stamp(Ready, room=room.room, transfer_id=ctx["transfer_id"], uuid=ctx["uuid"],
                                transfer_addr=ctx["transfer_addr"], backend=self.transfer.name, layout=self.layout,
                                page_count=len(pages_to_send(ctx)), first_token=ctx.get("first_token", 0),
                                first_logprob=ctx.get("first_logprob"), input_logprobs=ctx.get("input_logprobs"),
                                top_logprobs=ctx.get("top_logprobs"), cached_tokens=ctx.get("cached_tokens", 0))
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
