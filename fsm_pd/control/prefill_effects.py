"""Effect handlers of the prefill node (sender): gather and publish, READY/ABORT, release the staging buffer."""

from __future__ import annotations

import logging
from concurrent.futures import Future
from typing import TYPE_CHECKING

from fsm_pd.control.faults import FaultConfig, Faults
from fsm_pd.control.outbox import Outbox
from fsm_pd.control.overlap import publish_while_gathering
from fsm_pd.effects import EffectError, EffectInterpreter
from fsm_pd.kernels import gather_pages, resolve_impl
from fsm_pd.machines.effects import GatherAndPublish, ReleaseStaging, Send
from fsm_pd.transport import Abort, Ready
from fsm_pd.transport.backends import new_uuid

if TYPE_CHECKING:
    from fsm_pd.control.manager import KVManager
    from fsm_pd.effects import Node
    from fsm_pd.machines import Room

log = logging.getLogger(__name__)


class PrefillEffects:
    def __init__(self, manager: KVManager):
        self.m = manager
        self.staging: dict[int, int] = {}  # room -> uuid of a staging buffer being gathered or published
        self.faults = Faults(FaultConfig.from_env(), role="prefill")  # off unless FSM_PD_FAULT_* are set
        self.outbox = Outbox(manager.side_channel, self.faults, peer="decode node", best_effort=frozenset({"ABORT"}),
                             crash_after={"READY": "after_ready"})

    def interpreter(self) -> EffectInterpreter:
        return EffectInterpreter({GatherAndPublish: self.gather_and_publish, ReleaseStaging: self.release_staging,
                                  Send: self.send})

    def gather_and_publish(self, node: Node, room: Room, effect: GatherAndPublish) -> None:
        self.faults.crash("before_gather")
        uuid, pages, room_id = new_uuid(), list(room.ctx["pages"]), room.room
        self.staging[room_id] = uuid

        def gather(owner):
            if self.staging.get(room_id) != uuid:
                return  # the room ended while this waited for the model thread
            self.faults.check("gather")
            if self.m.backend.progressive and resolve_impl(owner.pool) == "cpu":
                self._publish_while_gathering(node, room_id, uuid, pages, owner.pool)
                return
            staging = gather_pages(owner.pool, pages, layout=self.m.layout)
            staging.block_until_ready()
            if self.staging.get(room_id) != uuid:
                return  # the room ended while we gathered: the buffer is simply dropped
            self.faults.crash("after_gather")
            self.faults.check("publish")
            self.m.backend.publish(uuid, (staging,), self.m.deadlines["pull_hold"])
            self._published(node, room_id, uuid, int(staging.shape[1]))

        def failed(done: Future) -> None:
            exc = done.exception()
            if exc is not None:  # the room fails; its ReleaseStaging then fails the entry if it was published
                node.submit(room_id, "error", {"blame": "local", "reason": f"gather/publish failed: {exc}"})

        self.m.model.submit(gather).add_done_callback(failed)

    def _publish_while_gathering(self, node: Node, room_id: int, uuid: int, pages: list[int], pool) -> None:
        """READY goes out and D connects while the model thread still copies; each layer streams once copied."""
        self.faults.check("publish")
        publish_while_gathering(self.m.backend, uuid, pool, pages, self.m.layout, self.m.deadlines["pull_hold"],
                                on_published=lambda rows: self._published(node, room_id, uuid, rows))
        self.faults.crash("after_gather")

    def _published(self, node: Node, room_id: int, uuid: int, rows: int) -> None:
        self.faults.crash("after_publish")
        node.submit(room_id, "published", {"uuid": uuid, "transfer_addr": self.m.backend.address, "rows": int(rows)})

    def release_staging(self, node: Node, room: Room, effect: ReleaseStaging) -> None:
        uuid = self.staging.pop(room.room, None)
        if uuid is None:
            return
        if room.state == "Success":
            self.faults.crash("after_pulled")
            self.m.backend.release(uuid)
        else:  # late pullers get an error at once instead of waiting for a buffer that is gone
            self.m.backend.fail(uuid, room.reason or "transfer failed")

    def send(self, node: Node, room: Room, effect: Send) -> None:
        ctx, channel = room.ctx, self.m.side_channel
        if effect.kind == "READY":
            msg = channel.stamp(Ready, room=room.room, transfer_id=ctx["transfer_id"], uuid=ctx["uuid"],
                                transfer_addr=ctx["transfer_addr"], backend=self.m.backend.name,
                                layout=self.m.layout.to_dict(), page_count=len(ctx["pages"]),
                                first_token=ctx.get("first_token", 0), first_logprob=ctx.get("first_logprob"),
                                input_logprobs=ctx.get("input_logprobs"))
        elif effect.kind == "ABORT":
            msg = channel.stamp(Abort, room=room.room, reason=room.reason or "aborted")
        else:
            raise EffectError(f"the prefill node does not send {effect.kind}")
        self.outbox.send(node, room.room, ctx["reply_to"], msg, effect.kind)

    def held(self) -> int:
        return len(self.staging)
