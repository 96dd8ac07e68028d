"""One simulated node: a slot (role, node id, addresses, journal file) and the process instance running in it.

An ``Instance`` is what a real process is: the production ``NodeCore``, ``Node``, effect handlers and ``PeerWatch``
(heartbeats of the peer, on this instance's timers), wired to the simulated ports. It dies whole: ``crash`` marks it
dead (its pending callbacks never run, its holdings are freed by its death) and drops its journal handle.
``SimNode.start`` runs a new instance at the same addresses, rebuilt from the journal by the production recovery
(``NodeCore.recover`` -> ``Node.recover``), with a new instance id.

``CrashableInterpreter`` crashes the process inside ``Node.step`` after the step's journal rows were committed and
before their effects ran: the window a write-ahead journal exists for.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from fsm_pd.control.core import NodeCore
from fsm_pd.control.peers import PeerWatch
from fsm_pd.effects import Node
from fsm_pd.effects.decode import DecodeEffects
from fsm_pd.effects.faults import Faults
from fsm_pd.effects.prefill import PrefillEffects
from fsm_pd.machines import RECEIVER, SENDER, Room
from fsm_pd.sim.bootstrap import SimResolver
from fsm_pd.sim.engine_schedulers import DecodeScheduler, PrefillScheduler
from fsm_pd.sim.kv import SimKV
from fsm_pd.sim.model import SimModel
from fsm_pd.sim.network import SimSideChannel
from fsm_pd.sim.shared_pool import SimPoolKV
from fsm_pd.sim.timeline import OwnedTimers
from fsm_pd.sim.transfer import SimPuller, SimTransferServer
from fsm_pd.transport.messages import new_instance_id

if TYPE_CHECKING:
    from fsm_pd.sim.world import World


class NodeCrashed(BaseException):
    """Raised inside ``Node.step`` to kill the process between journal commit and effects (not an ``Exception``:
    nothing in the loop may catch it)."""


class CrashableInterpreter:
    def __init__(self, inner: Any):
        self.inner = inner
        self.armed = False

    def run(self, node: Node, room: Room, decision: Any) -> None:
        if self.armed and decision.effects:
            self.armed = False
            raise NodeCrashed(f"{node.node_id} crashed after journaling room {room.room} v{decision.version}")
        self.inner.run(node, room, decision)


class Instance:
    def __init__(self, world: World, slot: SimNode, generation: int):
        self.alive = True
        self.died_at: float | None = None
        # stalled (SIGSTOP: every thread stopped, the process still there) until then: nothing it owns runs, no
        # frame reaches it, no ping is answered, its loop does not step; it all resumes then
        self.frozen_until = float("-inf")
        self.name = f"{slot.node_id}#{generation}"
        self.created: dict[int, float] = {}  # room -> when this instance created (or recovered) it
        w = self.world = world
        # a shared pool (--role pd): one process with the other role's instance, one model thread and allocator
        self.process = w.shared_process(slot, self)
        self.model = self.process.model if self.process is not None else SimModel(w.sched, self, lambda: w.model_delay)
        self.channel = SimSideChannel(w.network, self, slot.node_id, slot.address, new_instance_id(w.rng),
                                      healthy=self.answers_pings)
        faults = Faults(role=slot.role)  # FSM_PD_FAULT_* drive real processes; the simulation has its FaultPlan
        self.journal = w.open_journal(slot.role)
        # a pool on one CPU device copies layer by layer (overlapping the wire), one on an accelerator whole buffers
        self.progressive = w.rng.random() < w.config.progressive
        # and, progressive, whether its backend sends P's pages straight from the pool (tcp, the default) or gathers
        # them layer by layer into a published block (zmq)
        self.sends_pages = self.progressive and w.rng.random() < w.config.sends_pages
        layers = w.decode_layout["num_layers"]
        shared = self.process is not None
        if slot.role == "prefill":
            self.scheduler: PrefillScheduler | DecodeScheduler = PrefillScheduler(w, self)  # the engine's pool
            self.transfer = SimTransferServer(w.sched, w.ledger, self, slot.transfer_address, pool=shared)
            if shared:  # no byte moves, so no checksum (KVManager turns it off with a shared pool)
                kv = SimPoolKV(w.ledger, self, self.process.allocator)
            else:
                owner = self.scheduler.allocator.owner
                kv = SimKV(w.ledger, w.sched, self.model, self, w.page_bytes, layers, progressive=self.progressive,
                           sends_pages=self.sends_pages, allocator=self.scheduler.allocator,
                           room_of_pages=lambda pages: next((owner[p] for p in reversed(pages) if p in owner), None))
            self.effects: PrefillEffects | DecodeEffects = PrefillEffects(
                layout=w.prefill_layout, channel=self.channel, transfer=self.transfer, model=self.model, kv=kv,
                faults=faults, new_uuid=lambda: w.rng.getrandbits(63) or 1, kv_checksum=not shared)
            machine, deadlines, layout = SENDER, w.config.prefill_deadlines, w.prefill_layout
        else:
            self.scheduler = DecodeScheduler(w, self)
            self.allocator, self.admission = self.scheduler.allocator, self.scheduler.admission
            self.resolver = SimResolver(w.sched, self, w.plan, w.bootstrap)
            # the pool backend's pulls stay in the process: no partition cuts them
            partitioned = (lambda: False) if shared else (lambda: w.network.partitioned)
            self.resolver.record = w.record
            puller = SimPuller(w.sched, w.ledger, self, w.plan, w.transfer_server, partitioned, layers)
            puller.record = w.record
            kv = (SimPoolKV(w.ledger, self, self.process.allocator) if shared else
                  SimKV(w.ledger, w.sched, self.model, self, w.page_bytes, layers, progressive=self.progressive,
                        allocator=self.allocator))
            self.effects = DecodeEffects(
                layout=w.decode_layout, channel=self.channel, resolver=self.resolver, admission=self.admission,
                puller=puller, model=self.model, kv=kv, faults=faults, kv_checksum=not shared)
            machine, deadlines, layout = RECEIVER, w.config.decode_deadlines, w.decode_layout
        self.interpreter = CrashableInterpreter(self.effects.interpreter())
        self.node = Node(slot.node_id, machine, self.journal, self.interpreter, w.clock, deadlines)
        self.core = NodeCore(self.node, layout)
        self.channel.on_message = self.core.on_message
        forget = self.resolver.forget_peer if slot.role == "decode" else None
        self.peers = PeerWatch(self.node, self.channel, OwnedTimers(w.clock, self),
                               interval_s=w.config.heartbeat_interval, max_failures=w.config.heartbeat_max_failures,
                               forget=forget).start()
        if slot.role == "decode":
            self.resolver.resolver.watch_with(self.peers)
        w.network.bind(slot.address, self, self.channel.receive)

    def idle(self) -> bool:
        return self.model.queued() == 0

    def frozen(self) -> bool:
        return self.alive and self.frozen_until > self.world.clock.now()

    def answers_pings(self) -> bool:
        """The side channel's ``healthy`` hook (``SideChannel(healthy=...)``): a process answers pings only while
        it runs (a real one whose node loop or model thread died stops answering too; the simulation's never do)."""
        return self.alive and not self.frozen()


class SimNode:
    def __init__(self, world: World, role: str, node_id: str, address: str, transfer_address: str | None = None):
        self.world, self.role, self.node_id = world, role, node_id
        self.address, self.transfer_address = address, transfer_address
        self.generation = 0
        self.instance: Instance | None = None
        self.earlier: dict[int, Room] = {}  # rooms that ended in earlier instances (a restart reloads none)
        self.crashes = 0
        self.restart_after: float | None = None  # for a crash armed to happen inside a step

    @property
    def alive(self) -> bool:
        return self.instance is not None and self.instance.alive

    def start(self) -> Instance:
        """Start a new process instance at this slot's addresses, recovering from the journal."""
        old = self.instance
        if old is not None:
            assert not old.alive, "start a new instance only after the old one died"
            keep = old.node.rooms.values() if old.journal is None else (r for r in old.node.rooms.values()
                                                                         if r.terminal)
            self.earlier.update({r.room: r for r in keep})
        self.generation += 1
        inst = self.instance = Instance(self.world, self, self.generation)
        now = self.world.clock.now()
        for room in inst.core.recover():
            inst.created[room] = now
        self.world.started(self, inst)
        return inst

    def crash(self) -> None:
        inst = self.instance
        if inst is None or not inst.alive:
            return
        inst.alive = False
        inst.died_at = self.world.clock.now()
        inst.interpreter.armed = False
        self.crashes += 1
        self.world.ledger.crash(inst)
        if self.role == "prefill":
            inst.transfer.died()
        if inst.journal is not None:
            inst.journal.engine.dispose()  # the dead process's handle; every step was committed before it died

    def knows(self, room: int) -> bool:
        """Whether a process of this slot has had ``room``: ``room in live_rooms()`` without building it."""
        return room in self.earlier or (self.instance is not None and room in self.instance.node.rooms)

    def live_rooms(self) -> dict[int, Room]:
        """Every room this slot knows, as its processes left them: what replaying its journal must give."""
        current = self.instance.node.rooms if self.instance is not None else {}
        return {**self.earlier, **current}
