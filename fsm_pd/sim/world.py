"""A deterministic simulation of one prefill node, one decode node and the bootstrap server in one process.

Everything runs on one virtual clock and one seeded RNG. The nodes are the production code: ``NodeCore``, ``Node``, the
effect handlers (``PrefillEffects``, ``DecodeEffects``), the engines' admission and prefix caches
(``engine_schedulers.py``: ``take_prefill_batch``, ``Preallocation``, ``PrefixCache`` over the real ``PageAllocator``),
the ``PrefillResolver``, the machines and the SQLite journals. Only the ports are simulated (``fsm_pd.sim.network``,
``transfer``, ``bootstrap``, ``model``, ``kv``): the network carries the real signed frames and can drop, duplicate,
delay, reorder and partition them; either node can crash (also between journal commit and effects) and restart at the
same addresses as a new instance, rebuilt from its journal. The same seed gives the same history, byte for byte.

With ``SimConfig.shared_pool`` a world may run both roles as ``--role pd`` does on one set of devices: one process
with one pool, allocator and model thread, whose handoffs move page ownership (``shared_pool.py``). A crash or a
stall of either role is then one of the process: of both.

``run()`` is bounded in virtual time (``bounds.py``): a world that has not gone idle by then holds a room that
never ends, or work that never stops, and ``Stuck`` says which, instead of heartbeats ticking for ever.
"""

from __future__ import annotations

import os
import random
from array import array
from dataclasses import dataclass, field
from pathlib import Path

from fsm_pd.control.core import RoomInUse
from fsm_pd.effects import VirtualClock
from fsm_pd.machines.effect_types import ArmTimer
from fsm_pd.sim.armed import ArmedDeadlines
from fsm_pd.sim.bootstrap import SimBootstrap
from fsm_pd.sim.bounds import Stuck, settle_bound, still_going
from fsm_pd.sim.faults import FaultPlan
from fsm_pd.sim.ledger import Ledger
from fsm_pd.sim.network import SimNetwork
from fsm_pd.sim.nodes import Instance, NodeCrashed, SimNode
from fsm_pd.sim.shared_pool import SharedProcess
from fsm_pd.sim.timeline import Timeline
from fsm_pd.sim.transfer import SimTransferServer
from fsm_pd.sim.workload import Conversations
from fsm_pd.store import Journal

LAYOUT = {"num_layers": 4, "page_size": 16, "kv_heads": 2, "head_dim": 64, "dtype": "float32", "shard_axis": None}
BYTES_PER_VALUE = 4


@dataclass(frozen=True, slots=True)
class Fault:
    """One injected fault: when, what (``message drop``, ``crash``, ``stall``, ``client abort``, ...), the room it hit
    (None: the whole node or the network) and where."""

    at: float
    kind: str
    room: int | None
    detail: str
    lasts: float = 0.0  # a node-wide fault: how long it held (a stall's or partition's length, a crash's downtime)


@dataclass(frozen=True, slots=True)
class SimConfig:
    requests: int = 100
    seed: int = 0
    fault_rate: float = 0.0
    num_pages: int = 8192  # the decode pool
    prefill_pages: int = 2048  # the prefill engine's pool: its prefix cache fills it, LRU eviction gives way
    decode_radix_cache: float = 0.5  # the chance that the decode node runs its own prefix cache (per world)
    max_prompt: int = 2048
    mean_interarrival: float = 0.002
    # The decode node's wait for free pages (admission) is long enough for the queue a burst builds, and the prefill
    # node's bootstrap deadline, which waits for the PREPARE that comes after that queue, longer still (the decode
    # node names a wait too long and tells the prefill node). The other deadlines are short, so faults end soon.
    prefill_deadlines: dict = field(default_factory=lambda: {"bootstrap": 30.0, "waiting": 5.0, "pull_hold": 5.0})
    decode_deadlines: dict = field(default_factory=lambda: {"bootstrap": 5.0, "admission": 20.0, "waiting": 5.0,
                                                            "transfer": 5.0})
    max_delay_s: float = 10.0  # how late the network may deliver a delayed frame (twice the short deadlines)
    heartbeat_interval: float = 1.0
    heartbeat_max_failures: int = 2
    restart_after: float = 3.0
    decode_tokens: int = 64  # a request that succeeded decodes 1 to this many tokens (a page every page_size)
    model_delay: float = 0.0005  # per model-thread job
    progressive: float = 0.5  # the chance that a process instance copies KV layer by layer (a CPU pool, tcp)
    chunked: float = 0.5  # the chance (per world) that P prefills in chunks and hands prompts off piece by piece
    chunk_tokens: int = 64  # its chunk size then (``--chunked-prefill-size``): pieces of chunk_tokens / page_size pages
    sends_pages: float = 0.7  # the chance that a progressive prefill instance sends from its pool (tcp, not zmq)
    # tensor-parallel sizes: a handoff between different ones moves one piece per run of KV slots (transport/reshard)
    prefill_tp: int = 1
    decode_tp: int = 1
    # the chance (per world) that both roles are one process sharing one pool of num_pages + prefill_pages pages,
    # as ``--role pd`` (backend ``pool``): a handoff moves page ownership (``shared_pool.py``); 0 draws nothing
    shared_pool: float = 0.0

    def __post_init__(self):
        if self.shared_pool > 0 and (self.prefill_tp, self.decode_tp) != (1, 1):
            raise ValueError("a shared pool is one pool on one set of devices: no tensor-parallel split")


def _split(tp: int) -> dict:
    return {"tp": tp, "shard_axis": "tp"} if tp > 1 else {}


class World:
    prefill_id, decode_id = "prefill-0", "decode-0"
    prefill_addr, decode_addr = "tcp://10.0.0.1:7000", "tcp://10.0.0.2:7000"
    transfer_addr = "sim://10.0.0.1:7100"
    bootstrap_addr = "10.0.0.1:8998"

    def __init__(self, config: SimConfig, journal_dir: str | os.PathLike | None = None, durability: str = "normal"):
        self.config = config
        self.rng = random.Random(config.seed)
        self.clock = VirtualClock()
        self.sched = Timeline(self.clock)
        self.plan = FaultPlan(config.fault_rate, self.rng)
        self.ledger = Ledger(self.clock)
        self.network = SimNetwork(self.sched, self.rng, self.plan, self.rng.randbytes(32), config.max_delay_s)
        self.network.record = self.record
        self.fault_log: list[Fault] = []  # every fault injected, for the oracles that a fault must explain
        self.longest_stall = 0.0
        self.entered: dict[tuple[str, int], float] = {}  # (instance, room) -> when its state's deadline was armed
        # (instance, room) -> how far progress pushed its deadlines out (a chunked handoff restarts its state's)
        self.extended: dict[tuple[str, int], float] = {}
        self.armed = ArmedDeadlines()  # the deadline each live room runs under (``invariants.overdue_states``)
        self.bootstrap = SimBootstrap(self.bootstrap_addr)
        self.decode_layout = {**LAYOUT, "num_pages": config.num_pages, **_split(config.decode_tp)}
        self.prefill_layout = {**LAYOUT, "num_pages": config.prefill_pages, **_split(config.prefill_tp)}
        self.page_bytes = (LAYOUT["num_layers"] * LAYOUT["page_size"] * 2 * LAYOUT["kv_heads"] * LAYOUT["head_dim"]
                           * BYTES_PER_VALUE)
        self.model_delay = config.model_delay
        self.workload = Conversations(self.rng, LAYOUT["page_size"])
        self.decode_radix_cache = self.rng.random() < config.decode_radix_cache
        self.chunk_tokens = config.chunk_tokens if self.rng.random() < config.chunked else 0
        self.shared_pool = config.shared_pool > 0 and self.rng.random() < config.shared_pool  # no draw at 0
        self.shared_pages = config.num_pages + config.prefill_pages  # the one pool of --role pd: both together
        if self.shared_pool:
            self.decode_layout = self.prefill_layout = {**LAYOUT, "num_pages": self.shared_pages}
        self.journal_dir = Path(journal_dir) if journal_dir is not None else None
        if self.journal_dir is not None:
            self.journal_dir.mkdir(parents=True, exist_ok=True)
        self.durability = durability
        self.journal_tails: dict[str, object] = {}  # the invariants' incremental readers (closed with the world)
        self.requests: dict[int, int] = {}  # room -> prompt length (of its first request)
        self.arrives_at: dict[int, float] = {}  # room -> when its (first) request reaches the nodes
        self.ended_at: dict[tuple[str, int], float] = {}  # (role, room) -> when its side last ended (``attribution``)
        self.refused: list[tuple[str, int]] = []  # (role, room): a request its node refused (the room was used)
        self.reuse_accepted: list[str] = []  # a node took a room it had used before: it must refuse it
        self.pending_arrivals = 0
        self.restarts_pending = 0
        self.last_start = 0.0  # the latest time a scheduled request or restart begins
        self.instances: dict[str, Instance] = {}  # every process instance that ran, by its instance id
        # called whenever the nodes have settled after a timer fired: checks that must hold at every instant, not
        # only between the property suite's rules (a rule may move time on by seconds)
        self.probes: list = []
        self.prefill = SimNode(self, "prefill", self.prefill_id, self.prefill_addr, self.transfer_addr)
        self.decode = SimNode(self, "decode", self.decode_id, self.decode_addr)
        self.prefill.start()
        self.decode.start()

    # --- faults, recorded ---
    def record(self, kind: str, room: int | None, detail: str, lasts: float = 0.0) -> None:
        self.fault_log.append(Fault(self.clock.now(), kind, room, detail, lasts))

    def faults_of(self, room: int | None = None, kind: str = "") -> list[Fault]:
        """The recorded faults of ``kind`` (a prefix) that hit ``room`` or everything (room None)."""
        return [f for f in self.fault_log if f.kind.startswith(kind) and (f.room is None or f.room == room)]

    def stall(self, role: str, seconds: float) -> None:
        """SIGSTOP ``role``'s process for ``seconds``: it stays there (its sockets accept) but nothing in it runs;
        frames and pulls wait, its timers fire late, it answers no ping; then it carries on where it was."""
        slot = self.prefill if role == "prefill" else self.decode
        if not slot.alive or seconds <= 0:
            return
        for stopped in self.process_of(slot):
            inst = stopped.instance
            inst.frozen_until = max(inst.frozen_until, self.clock.now() + seconds)
            self.record("stall", None, f"{inst.name} stopped for {seconds:g} s", seconds)
        self.longest_stall = max(self.longest_stall, seconds)
        self.sched.later(seconds, lambda: None, work=False)  # the world settles (and steps it) when it resumes

    # --- wiring ---
    def open_journal(self, role: str) -> Journal | None:
        if self.journal_dir is None:
            return None
        return Journal(self.journal_dir / f"{role}.db", durability=self.durability)

    def transfer_server(self, address: str) -> SimTransferServer | None:
        inst = self.prefill.instance
        return inst.transfer if inst is not None and address == self.transfer_addr else None

    def started(self, slot: SimNode, inst: Instance) -> None:
        """A new instance runs in ``slot``: hook it up the way its engine and the deployment would."""
        self.instances[inst.channel.instance_id] = inst
        inst.node.observers.append(lambda room, decision, at: inst.scheduler.observed(room, decision))
        inst.node.observers.append(lambda room, decision, at: self._entered(inst, room, decision))
        inst.node.observers.append(lambda room, decision, at: self._ended(slot.role, room, decision))
        inst.node.observers.append(lambda room, decision, at: self.armed.observe(
            inst.name, room, decision, self.clock.now(), inst.node))
        if slot.role == "prefill":
            self.bootstrap.register({"rank_ip": "10.0.0.1", "rank_port": 7000, "side_channel": slot.address,
                                     "transfer_addr": slot.transfer_address, "transfer_backend": "sim",
                                     "kv_layout": self.prefill_layout, "node_id": slot.node_id,
                                     "instance": inst.channel.instance_id})

    def _entered(self, inst: Instance, room: object, decision: object) -> None:
        """How far progress pushed a room's deadlines out (a chunked handoff restarts its state's): the room's
        whole-life bound (``invariants.overdue_rooms``) moves by as much."""
        key, now = (inst.name, room.room), self.clock.now()
        if decision.dst != decision.src or decision.trigger == "create":
            self.entered[key] = now
        elif decision.ignored is None and any(isinstance(e, ArmTimer) for e in decision.effects):
            self.extended[key] = self.extended.get(key, 0.0) + now - self.entered.get(key, now)  # restarted
            self.entered[key] = now

    def _ended(self, role: str, room: object, decision: object) -> None:
        if decision.dst != decision.src and room.terminal:
            self.ended_at[(role, room.room)] = self.clock.now()

    # --- requests and clients ---
    def add_request(self, room: int, prompt_len: int, at: float) -> None:
        """The router sends the request to both nodes at once (each leg with its own small delay). A room already
        used is sent again as a client would (a retry, a collision): each node must refuse it."""
        self.requests.setdefault(room, prompt_len)
        self.arrives_at.setdefault(room, at)
        # shares prefixes with earlier prompts (the caches hit); kept as 2-byte tokens until it arrives, since every
        # arrival of a run is scheduled at its start
        tokens = array("H", self.workload.prompt(prompt_len))
        self.pending_arrivals += 2
        self.last_start = max(self.last_start, at + 0.02)  # the legs' jitter and a client's abort come within 20 ms
        now = self.clock.now()
        self.sched.later(at - now + self.rng.random() * 0.001, lambda: self._arrive_prefill(room, tokens),
                         work=False)
        self.sched.later(at - now + self.rng.random() * 0.001, lambda: self._arrive_decode(room, tokens),
                         work=False)
        if self.plan.client_abort():
            side = self.rng.choice(("prefill", "decode"))
            self.sched.later(at - now + self.rng.random() * 0.02, lambda: self.abort(side, room, "client went away"),
                             work=False)

    def _arrive_prefill(self, room: int, tokens: array) -> None:
        """The engine creates the room; its scheduler queues the prompt once PREPARE came (``engine_schedulers.py``)."""
        inst = self.prefill.instance
        if inst.frozen():  # its HTTP server is stopped too: the request waits in the socket
            self.sched.later(inst.frozen_until - self.clock.now(), lambda: self._arrive_prefill(room, tokens),
                             work=False)
            return
        self.pending_arrivals -= 1
        if inst.alive and self._accepted(self.prefill, room, lambda: inst.core.add_sender(
                room, prompt_len=len(tokens))):
            inst.created[room] = self.clock.now()
            inst.scheduler.arrived(room, tokens)
        # else: connection refused, or the room was used: the decode leg finds out through its own deadlines

    def _arrive_decode(self, room: int, tokens: array) -> None:
        """The engine creates the room and queues the request for pages (``engine_schedulers.py``)."""
        inst = self.decode.instance
        if inst.frozen():
            self.sched.later(inst.frozen_until - self.clock.now(), lambda: self._arrive_decode(room, tokens),
                             work=False)
            return
        self.pending_arrivals -= 1
        if inst.alive and self._accepted(self.decode, room, lambda: inst.core.add_receiver(
                room, page_count=-(-len(tokens) // LAYOUT["page_size"]), prompt_len=len(tokens),
                bootstrap_addr=self.bootstrap_addr)):
            inst.created[room] = self.clock.now()
            inst.scheduler.arrived(room, tokens)

    def flush_cache(self, role: str) -> None:
        """SGLang's ``/flush_cache`` on ``role``'s node (refused while a request is live there)."""
        slot = self.prefill if role == "prefill" else self.decode
        if slot.alive:
            slot.instance.scheduler.flush()

    def _accepted(self, slot: SimNode, room: int, create) -> bool:
        """Create the room as the node's engine does; False if the node refused it (``RoomInUse``). A node that
        takes a room it has used before (live, ended, or journaled by an earlier process) is a violation."""
        used = slot.knows(room)
        try:
            create()
        except RoomInUse:
            self.refused.append((slot.role, room))
            return False
        if used:
            self.reuse_accepted.append(f"{slot.role} node accepted room {room} again at t={self.clock.now():.4f}")
        return True

    def abort(self, side: str, room: int, reason: str) -> None:
        inst = (self.prefill if side == "prefill" else self.decode).instance
        if inst.alive and room in inst.created:
            self.record("client abort", room, f"on the {side} node")
            inst.core.abort(room, reason)

    # --- crashes ---
    def crash(self, role: str, *, restart_after: float | None = None, after_commit: bool = False) -> None:
        """Kill ``role``'s process now, or (``after_commit``) inside its next step that has effects to run, after
        the step's journal rows are committed. With ``restart_after``, a new instance starts that much later."""
        slot = self.prefill if role == "prefill" else self.decode
        if not slot.alive:
            return
        if after_commit:
            slot.instance.interpreter.armed = True
            slot.restart_after = restart_after
            return
        for dying in self.process_of(slot):
            self.record("crash", None, f"{dying.instance.name} killed", restart_after or 0.0)
            dying.crash()
            self._schedule_restart(dying, restart_after)

    def process_of(self, slot: SimNode) -> list[SimNode]:
        """The slots whose instances are one process with ``slot``'s: both in a shared pool, else ``slot`` alone."""
        return [s for s in (self.prefill, self.decode) if s.alive] if self.shared_pool else [slot]

    def shared_process(self, slot: SimNode, inst: Instance) -> SharedProcess | None:
        """The shared pool a new instance ``inst`` in ``slot`` joins: the running instance's of the other role, or
        a new one (a process that starts, or starts again after it died whole). None without a shared pool."""
        if not self.shared_pool:
            return None
        other = self.decode if slot is self.prefill else self.prefill
        return other.instance.process if other.alive else SharedProcess(self, inst)

    def crash_prefill(self) -> None:
        self.crash("prefill", restart_after=self.config.restart_after)

    def heal(self) -> None:
        """The fault phase is over: no more faults of any kind, partitions healed, a crash armed for a later step
        disarmed, and every node that is down started again now (a restart still scheduled then finds it up)."""
        plan = self.plan
        plan.rate, plan.slow_pulls_s, plan.fail_next_pull, plan.fail_next_resolve = 0.0, 0.0, 0, 0
        plan.corrupt_next_pull = 0
        plan.forced_messages.clear()
        self.model_delay = self.config.model_delay
        self.network.partitioned_until = float("-inf")
        for slot in (self.prefill, self.decode):
            if slot.alive:
                slot.instance.interpreter.armed = False
                slot.instance.frozen_until = min(slot.instance.frozen_until, self.clock.now())  # SIGCONT
            else:
                slot.start()

    def _schedule_restart(self, slot: SimNode, after: float | None) -> None:
        if after is None:
            return
        dead = slot.instance
        self.restarts_pending += 1
        self.last_start = max(self.last_start, self.clock.now() + after)

        def restart() -> None:
            self.restarts_pending -= 1
            if slot.instance is dead:
                slot.start()

        self.sched.later(after, restart, work=False)

    # --- running ---
    def step_nodes(self) -> int:
        done = 0
        for slot in (self.decode, self.prefill):
            if not slot.alive or slot.instance.frozen():
                continue
            try:
                done += slot.instance.node.step()
            except NodeCrashed as exc:
                self.record("crash", None, str(exc), slot.restart_after or 0.0)
                for dying in self.process_of(slot):
                    if dying is not slot:
                        self.record("crash", None, f"{dying.instance.name} killed with its process",
                                    slot.restart_after or 0.0)
                    dying.crash()
                    self._schedule_restart(dying, slot.restart_after)
                done += 1
        return done

    def run(self, until: float | None = None, *, within: float | None = None) -> None:
        """Process events and fire timers until nothing is left to do, or until virtual time ``until``. Heartbeats
        alone are not something to do: they tick for ever, and would never let an idle world stop. Without
        ``until``, the world must go idle within ``within`` virtual seconds (default ``settle_bound``: see
        ``bounds.py``), else ``Stuck``."""
        limit = None if until is not None else self.clock.now() + (settle_bound(self) if within is None else within)
        while True:
            self._settle()
            nxt = self.clock.next_time()
            if nxt is None or (until is not None and nxt > until) or self.idle():
                break
            if limit is not None and nxt > limit:
                raise Stuck(still_going(self, limit))
            self.clock.fire_next()
        if until is not None:
            self.clock.advance_to(until)

    def run_until(self, predicate, limit: int = 100_000) -> bool:
        """Fire timers one at a time until ``predicate()`` holds (True) or nothing is left to fire (False)."""
        for _ in range(limit):
            self._settle()
            if predicate():
                return True
            if self.idle() or not self.clock.fire_next():
                return False
        return predicate()

    def quiet(self) -> bool:
        """No work under way: nothing held now can still be let go by a callback or a queued job."""
        return self.sched.in_flight == 0 and all(s.instance.idle() for s in (self.prefill, self.decode) if s.alive)

    def _settle(self) -> None:
        while self.step_nodes():
            pass
        for probe in self.probes:
            probe()

    def idle(self) -> bool:
        """Quiet, every room ended, no request or restart still to come: only heartbeats would fire now."""
        if self.pending_arrivals or self.restarts_pending or not self.quiet():
            return False
        return all(room.terminal for slot in (self.prefill, self.decode) if slot.alive
                   for room in slot.instance.node.rooms.values())

    @property
    def crashes(self) -> int:
        return self.prefill.crashes

    def live_rooms(self) -> dict[tuple[str, str, int], object]:
        """Every room either node has known in this run, by (node, role, room): what replay must reproduce."""
        return {(slot.node_id, slot.role, r): room for slot in (self.prefill, self.decode)
                for r, room in slot.live_rooms().items()}

    def close(self) -> None:
        for tail in self.journal_tails.values():
            tail.close()
        for slot in (self.prefill, self.decode):
            inst = slot.instance
            if inst is not None and inst.journal is not None:
                inst.journal.close()
