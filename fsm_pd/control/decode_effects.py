"""Effect handlers of the decode node (receiver): resolve, admit, PREPARE, pull and verify, scatter, free.

Pulls block, so they run on a small worker pool; every pool access (scatter, and freeing pages a queued scatter may
still write) is a job on the model thread, in order. A pulled buffer is scattered only after the backend verified it
(ready, error-free, shaped as our layout says), and only when the machine asks for it with ``Scatter``.

With a progressive backend and a pool on one CPU device, the scatter starts during the pull instead: each group of
layers is written as soon as it has landed (``StreamedScatter``), and ``Scatter`` only waits for the last writes.
A layer is final when it lands, and P's layout was checked before the first byte was accepted; what the pull can
still fail on is the rest of the stream, and then the room fails and its pages (some already written) are freed
behind every queued write, which finds the stream cancelled.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING

import jax
import numpy as np

from fsm_pd.control.faults import FaultConfig, Faults
from fsm_pd.control.outbox import Outbox
from fsm_pd.control.overlap import StreamedScatter
from fsm_pd.effects import EffectError, EffectInterpreter
from fsm_pd.kernels import page_bucket, resolve_impl, scatter_pages
from fsm_pd.machines.effects import FreePages, Pull, ReservePages, ResolveBootstrap, Scatter, Send
from fsm_pd.transport import Abort, Prepare, Pulled
from fsm_pd.transport.backends import TransferFailed, TransferTimeout

if TYPE_CHECKING:
    from fsm_pd.control.manager import KVManager
    from fsm_pd.effects import Node
    from fsm_pd.machines import Room

log = logging.getLogger(__name__)


class DecodeEffects:
    def __init__(self, manager: KVManager, pull_workers: int = 4):
        self.m = manager
        self.workers = ThreadPoolExecutor(max_workers=pull_workers, thread_name_prefix="pull")
        self.pulled: dict[int, jax.Array] = {}  # room -> verified staging waiting for Scatter
        self.streams: dict[int, StreamedScatter] = {}  # room -> layers written while its pull is in flight
        pool = manager.model.pool
        self.stream_layers = manager.backend.progressive and pool is not None and resolve_impl(pool) == "cpu"
        self.faults = Faults(FaultConfig.from_env(), role="decode")  # off unless FSM_PD_FAULT_* are set
        self.outbox = Outbox(manager.side_channel, self.faults, peer="prefill node",
                             best_effort=frozenset({"ABORT", "PULLED"}), crash_after={"PREPARE": "after_prepare"})

    def interpreter(self) -> EffectInterpreter:
        return EffectInterpreter({ResolveBootstrap: self.resolve_bootstrap, ReservePages: self.reserve_pages,
                                  Send: self.send, Pull: self.pull, Scatter: self.scatter,
                                  FreePages: self.free_pages})

    def resolve_bootstrap(self, node: Node, room: Room, effect: ResolveBootstrap) -> None:
        ctx = dict(room.ctx)

        def resolve():
            try:
                found = self.m.resolver(ctx)
            except Exception as exc:  # noqa: BLE001 - a lookup failure is the peer's side's fault
                node.submit(room.room, "error", {"blame": "remote", "reason": f"bootstrap lookup failed: {exc}"})
                return
            node.submit(room.room, "bootstrap_resolved", found)

        self.workers.submit(resolve)

    def reserve_pages(self, node: Node, room: Room, effect: ReservePages) -> None:
        self.m.admission.request(node, room.room, room.ctx.get("page_count"))

    def send(self, node: Node, room: Room, effect: Send) -> None:
        ctx, channel = room.ctx, self.m.side_channel
        if effect.kind == "PREPARE":
            msg = channel.stamp(Prepare, room=room.room, transfer_id=room.room, reply_to=channel.address,
                                layout=self.m.layout.to_dict(), page_count=len(ctx["pages"]),
                                prompt_len=int(ctx.get("prompt_len", 0)))
        elif effect.kind == "PULLED":
            msg = channel.stamp(Pulled, room=room.room, transfer_id=room.room)
        elif effect.kind == "ABORT":
            msg = channel.stamp(Abort, room=room.room, reason=room.reason or "aborted")
        else:
            raise EffectError(f"the decode node does not send {effect.kind}")
        self.outbox.send(node, room.room, ctx["prefill_addr"], msg, effect.kind)

    def pull(self, node: Node, room: Room, effect: Pull) -> None:
        ctx, layout = room.ctx, self.m.layout
        if int(ctx["page_count"]) != len(ctx["pages"]):
            raise EffectError(f"READY announces {ctx['page_count']} pages, we reserved {len(ctx['pages'])}",
                              blame="remote")
        spec = (jax.ShapeDtypeStruct(layout.staging_shape(page_bucket(len(ctx["pages"]))), layout.dtype,
                                     sharding=self.m.staging_sharding),)
        address, uuid, room_id = ctx["transfer_addr"], int(ctx["uuid"]), room.room
        timeout = self.m.deadlines["transfer"]
        stream = None
        if self.stream_layers:  # registered before the pull starts, so that FreePages can always cancel it
            stream = self.streams[room_id] = StreamedScatter(self.m.model, layout, list(ctx["pages"]),
                                                             self.m.staging_sharding)

        def work():
            self.faults.crash("before_pull")
            delay = max(self.m.fault_pull_delay_s, self.faults.pull_delay_s)
            if delay:
                time.sleep(delay)
            try:
                self.faults.check("pull")
                (staging,) = self.m.backend.pull(address, uuid, spec, timeout,
                                                 on_progress=None if stream is None else stream.on_progress)
            except TransferTimeout as exc:
                node.submit(room_id, "error", {"blame": "timeout", "reason": f"pull timed out: {exc}"})
            except TransferFailed as exc:
                node.submit(room_id, "error", {"blame": exc.blame, "reason": f"pull failed: {exc.reason}"})
            except Exception as exc:  # noqa: BLE001
                node.submit(room_id, "error", {"blame": "local", "reason": f"pull failed: {exc}"})
            else:
                self.faults.crash("after_pull")
                self.pulled[room_id] = staging
                node.submit(room_id, "pulled", {"bytes": int(staging.nbytes)})

        self.workers.submit(work)

    def scatter(self, node: Node, room: Room, effect: Scatter) -> None:
        self.faults.crash("before_scatter")
        room_id, pages = room.room, list(room.ctx["pages"])
        staging, stream = self.pulled.pop(room_id), self.streams.pop(room_id, None)
        if stream is not None and stream.submitted:
            stream.on_progress(0, np.asarray(staging), staging.nbytes)  # whatever the pull's last report left

        def write(owner):
            self.faults.check("scatter")
            if stream is not None and stream.submitted:
                stream.written(owner)
                return
            owner.pool = scatter_pages(owner.pool, staging, pages, layout=self.m.layout)
            jax.block_until_ready(owner.pool)

        def done(future):
            exc = future.exception()
            if exc is None:
                self.faults.crash("after_scatter")
                node.submit(room_id, "scattered", {})
            else:
                node.submit(room_id, "error", {"blame": "local", "reason": f"scatter failed: {exc}"})

        self.m.model.submit(write).add_done_callback(done)

    def free_pages(self, node: Node, room: Room, effect: FreePages) -> None:
        self.pulled.pop(room.room, None)
        stream = self.streams.pop(room.room, None)

        def free(owner) -> None:  # on the model thread: after any write still queued for these pages
            if stream is not None:
                stream.cancel()  # and writes queued later (a pull still landing layers) find it cancelled
            self.m.admission.release(node, room.room)

        self.m.model.submit(free)

    def close(self) -> None:
        self.workers.shutdown(wait=False, cancel_futures=True)
