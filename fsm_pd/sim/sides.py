"""Effect handlers of the simulated prefill and decode nodes.

They stand in for the data plane (gather, publish, pull, scatter), the bootstrap server and the page pool, with
latencies on the virtual clock and faults from the plan. They talk to the machines only through ``node.submit``,
exactly like the real handlers, so the machines, the effect interpreter and the journal are the real ones.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from fsm_pd.effects import EffectInterpreter
from fsm_pd.machines.effects import (
    FreePages,
    GatherAndPublish,
    Pull,
    ReleaseStaging,
    ReservePages,
    ResolveBootstrap,
    Scatter,
    Send,
)

if TYPE_CHECKING:
    from fsm_pd.sim.world import World

NETWORK_BYTES_PER_S = 2.5e9


def prefill_interpreter(world: World) -> EffectInterpreter:
    def gather_and_publish(node, room, effect):
        uuid = world.rng.getrandbits(63)
        world.staging.allocate(room.room, uuid)
        world.after(0.001, node, room.room, "published", {"uuid": uuid, "transfer_addr": world.prefill_id})

    def release_staging(node, room, effect):
        world.staging.release(room.room)

    def send(node, room, effect):
        body = {}
        if effect.kind == "READY":
            body = {"peer_layout": world.prefill_layout, "uuid": room.ctx["uuid"],
                    "first_token": world.rng.randrange(256)}
        elif effect.kind == "ABORT":
            body = {"reason": room.reason}
        world.send("decode", effect.kind, room.room, body)

    return EffectInterpreter({GatherAndPublish: gather_and_publish, ReleaseStaging: release_staging, Send: send})


def decode_interpreter(world: World) -> EffectInterpreter:
    def resolve_bootstrap(node, room, effect):
        if world.faults.resolve_fails():
            world.after(0.001, node, room.room, "error",
                        {"blame": "remote", "reason": "bootstrap server unreachable"})
        elif not world.prefill_up:
            world.after(0.001, node, room.room, "error",
                        {"blame": "remote", "reason": f"{world.prefill_id} is not registered with bootstrap"})
        else:
            world.after(0.001, node, room.room, "bootstrap_resolved", {"peer": world.prefill_id})

    def reserve_pages(node, room, effect):
        world.reserve_or_wait(room.room, room.ctx["page_count"])

    def send(node, room, effect):
        body = {}
        if effect.kind == "PREPARE":
            body = {"peer": world.decode_id, "peer_layout": world.decode_layout,
                    "page_count": room.ctx["page_count"], "transfer_id": room.room}
        elif effect.kind == "ABORT":
            body = {"reason": room.reason}
        world.send("prefill", effect.kind, room.room, body)

    def pull(node, room, effect):
        nbytes = room.ctx["page_count"] * world.page_bytes
        delay = 0.0005 + nbytes / NETWORK_BYTES_PER_S
        if world.faults.pull_fails():
            world.after(delay, node, room.room, "error", {"blame": "remote", "reason": "pull failed: connection reset"})
        elif not world.staging.is_published(room.room, room.ctx["uuid"]) or not world.prefill_up:
            world.after(delay, node, room.room, "error",
                        {"blame": "remote", "reason": "published entry is gone (released or prefill restarted)"})
        else:
            world.after(delay, node, room.room, "pulled", {"bytes": nbytes})

    def scatter(node, room, effect):
        world.after(0.001, node, room.room, "scattered", {})

    def free_pages(node, room, effect):
        world.release_pages(room.room, "failed")

    return EffectInterpreter({ResolveBootstrap: resolve_bootstrap, ReservePages: reserve_pages, Send: send,
                              Pull: pull, Scatter: scatter, FreePages: free_pages})


class StagingLedger:
    """P's staging buffers: who holds one, and a record of anything released twice or leaked."""

    def __init__(self):
        self.held: dict[int, int] = {}  # room -> uuid
        self.allocations: dict[int, int] = {}
        self.releases: dict[int, int] = {}
        self.lost_in_crash: set[int] = set()
        self.violations: list[str] = []

    def allocate(self, room: int, uuid: int) -> None:
        if room in self.allocations:
            self.violations.append(f"room {room}: staging allocated twice")
        self.allocations[room] = self.allocations.get(room, 0) + 1
        self.held[room] = uuid

    def release(self, room: int) -> None:
        if room in self.held:
            del self.held[room]
            self.releases[room] = self.releases.get(room, 0) + 1
        elif room in self.releases and room not in self.lost_in_crash:
            self.violations.append(f"room {room}: staging released twice")

    def crash(self) -> None:
        """The process died: its memory, and every staging buffer in it, is gone."""
        for room in self.held:
            self.releases[room] = self.releases.get(room, 0) + 1
            self.lost_in_crash.add(room)
        self.held.clear()

    def is_published(self, room: int, uuid: int) -> bool:
        return self.held.get(room) == uuid
