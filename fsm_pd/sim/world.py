"""A deterministic simulation of one prefill node, one decode node and the bootstrap server in one process.

Everything runs on a virtual clock and one seeded RNG: requests arrive, the side channel delivers (or drops,
duplicates, delays) messages, the prefill node may crash and restart on its journal, clients abort. The machines,
the effect interpreter, the node loop and the SQLite journals are the real ones; only the data plane, the network
and the model are simulated. The same seed gives the same history, row for row.
"""

from __future__ import annotations

import os
import random
from collections import Counter, deque
from dataclasses import dataclass, field
from pathlib import Path

from fsm_pd.effects import Node, VirtualClock
from fsm_pd.engine.pages import OutOfPages, PageAllocator
from fsm_pd.kernels.layout import KVLayout
from fsm_pd.machines import RECEIVER, SENDER
from fsm_pd.sim.faults import FaultPlan
from fsm_pd.sim.sides import StagingLedger, decode_interpreter, prefill_interpreter
from fsm_pd.store import Journal

PREFILL_TRIGGERS = {"PREPARE": "metadata_received", "PULLED": "pull_done", "ABORT": "peer_abort"}
DECODE_TRIGGERS = {"READY": "kv_published", "ABORT": "peer_abort"}


@dataclass(frozen=True, slots=True)
class SimConfig:
    requests: int = 100
    seed: int = 0
    fault_rate: float = 0.0
    page_size: int = 16
    num_pages: int = 8192
    max_prompt: int = 2048
    mean_interarrival: float = 0.002
    prefill_deadlines: dict = field(default_factory=lambda: {"bootstrap": 5.0, "waiting": 5.0, "pull_hold": 5.0})
    decode_deadlines: dict = field(default_factory=lambda: {"bootstrap": 5.0, "waiting": 5.0, "transfer": 5.0})
    heartbeat_interval: float = 1.0
    heartbeat_max_failures: int = 2
    restart_after: float = 3.0
    decode_time: float = 0.05


class World:
    prefill_id = "prefill-0"
    decode_id = "decode-0"

    def __init__(self, config: SimConfig, journal_dir: str | os.PathLike | None = None, durability: str = "normal"):
        self.config = config
        self.rng = random.Random(config.seed)
        self.faults = FaultPlan(config.fault_rate, self.rng)
        self.clock = VirtualClock()
        layout = KVLayout(num_layers=4, num_pages=config.num_pages, page_size=config.page_size, kv_heads=2,
                          head_dim=64)
        self.decode_layout = layout.to_dict()
        self.prefill_layout = {**self.decode_layout, "num_pages": config.num_pages * 2}
        self.page_bytes = layout.page_bytes()
        self.pages = PageAllocator(config.num_pages)
        self.page_waiters: deque[tuple[int, int]] = deque()
        self.page_releases: dict[int, list[str]] = {}
        self.staging = StagingLedger()
        self.journal_dir = Path(journal_dir) if journal_dir is not None else None
        if self.journal_dir is not None:
            self.journal_dir.mkdir(parents=True, exist_ok=True)
        self.durability = durability
        self.prefill = self._prefill_node()
        self.decode = Node(self.decode_id, RECEIVER, self._journal("decode"), decode_interpreter(self), self.clock,
                           config.decode_deadlines)
        self.decode.observers.append(self._on_decode_success)
        self.prefill_up = True
        self.finished_before_restart: dict = {}  # prefill rooms that ended before a crash (a restart reloads none)
        self.crashes = 0
        self.missed_heartbeats = 0
        self.pending_arrivals = 0
        self.requests: dict[int, int] = {}  # room -> prompt length
        self.messages = Counter()
        self._heartbeat_armed = False

    # --- construction ---
    def _journal(self, role: str) -> Journal | None:
        if self.journal_dir is None:
            return None
        return Journal(self.journal_dir / f"{role}.db", durability=self.durability)

    def _prefill_node(self) -> Node:
        return Node(self.prefill_id, SENDER, self._journal("prefill"), prefill_interpreter(self), self.clock,
                    self.config.prefill_deadlines)

    # --- scheduling helpers ---
    def after(self, delay: float, node: Node, room: int, trigger: str, payload: dict) -> None:
        """Deliver an event to ``node`` after ``delay`` virtual seconds (dropped if that node died meanwhile)."""
        self.clock.call_at(self.clock.now() + delay, lambda: node.submit(room, trigger, payload))

    def send(self, to: str, kind: str, room: int, body: dict) -> None:
        """The side channel: latency, and drop / duplicate / delay faults."""
        fate = self.faults.message()
        self.messages[fate] += 1
        if fate == "drop":
            return
        target = self.prefill if to == "prefill" else self.decode
        trigger = (PREFILL_TRIGGERS if to == "prefill" else DECODE_TRIGGERS).get(kind)
        if trigger is None:
            return
        latency = 0.0002 + self.rng.random() * 0.0003
        if fate == "delay":
            latency += self.rng.random() * 2 * max(self.config.decode_deadlines.values())
        copies = 2 if fate == "duplicate" else 1
        for i in range(copies):
            self.clock.call_at(self.clock.now() + latency + i * 0.0001,
                               lambda: self._deliver(target, to, room, trigger, body))

    def _deliver(self, target: Node, to: str, room: int, trigger: str, body: dict) -> None:
        if to == "prefill" and (not self.prefill_up or target is not self.prefill):
            return  # the process that would have received it is dead
        target.submit(room, trigger, body)

    # --- requests, pages, faults ---
    def add_request(self, room: int, prompt_len: int, at: float) -> None:
        """The router sends the request to both nodes at once (each leg with its own small delay)."""
        self.requests[room] = prompt_len
        self.pending_arrivals += 2
        layout_pages = -(-prompt_len // self.config.page_size)
        prefill_time = 0.002 + prompt_len * 1e-5
        self.clock.call_at(at + self.rng.random() * 0.001, lambda: self._arrive_prefill(room, prompt_len, prefill_time))
        self.clock.call_at(at + self.rng.random() * 0.001, lambda: self._arrive_decode(room, prompt_len, layout_pages))
        if self.faults.client_abort():
            side = self.rng.choice(("prefill", "decode"))
            self.clock.call_at(at + self.rng.random() * 0.02, lambda: self.abort(side, room, "client went away"))
        self._arm_heartbeat()

    def _arrive_prefill(self, room: int, prompt_len: int, prefill_time: float) -> None:
        self.pending_arrivals -= 1
        if not self.prefill_up:
            return  # the router's connection is refused; the decode leg finds out through its own deadlines
        node = self.prefill
        node.create(room, {"layout": self.prefill_layout, "prompt_len": prompt_len})
        self.after(prefill_time, node, room, "kv_ready", {})

    def _arrive_decode(self, room: int, prompt_len: int, page_count: int) -> None:
        self.pending_arrivals -= 1
        self.decode.create(room, {"layout": self.decode_layout, "prompt_len": prompt_len, "page_count": page_count})

    def abort(self, side: str, room: int, reason: str) -> None:
        node = self.prefill if side == "prefill" else self.decode
        if side == "prefill" and not self.prefill_up:
            return
        if room in node.rooms:
            node.submit(room, "abort", {"reason": reason})

    def reserve_or_wait(self, room: int, count: int) -> None:
        self.page_waiters.append((room, count))
        self._grant_pages()

    def _grant_pages(self) -> None:
        while self.page_waiters:
            room, count = self.page_waiters[0]
            state = self.decode.rooms.get(room)
            if state is None or state.terminal:
                self.page_waiters.popleft()  # the room gave up while queued: nothing to reserve
                continue
            try:
                pages = self.pages.reserve(room, count)
            except OutOfPages:
                return
            self.page_waiters.popleft()
            self.after(0.0001, self.decode, room, "pages_reserved", {"pages": pages})

    def release_pages(self, room: int, cause: str) -> None:
        if self.pages.free(room):
            self.page_releases.setdefault(room, []).append(cause)
            self._grant_pages()

    def crash_prefill(self) -> None:
        """SIGKILL the prefill node: its rooms, timers and staging buffers vanish; it restarts on its journal."""
        if not self.prefill_up:
            return
        self.prefill_up = False
        self.crashes += 1
        self.staging.crash()
        self.clock.call_at(self.clock.now() + self.config.restart_after, self._restart_prefill)

    def _restart_prefill(self) -> None:
        self.finished_before_restart.update({r.room: r for r in self.prefill.rooms.values() if r.terminal})
        if self.prefill.journal is not None:
            self.prefill.journal.engine.dispose()  # the dead process's handle; nothing unflushed survives a crash
        self.prefill = self._prefill_node()
        self.prefill_up = True
        self.missed_heartbeats = 0
        self.prefill.recover("node restarted")

    def _arm_heartbeat(self) -> None:
        if not self._heartbeat_armed:
            self._heartbeat_armed = True
            self.clock.call_at(self.clock.now() + self.config.heartbeat_interval, self._heartbeat)

    def live_rooms(self) -> dict[tuple[str, str, int], object]:
        """Every room either node has known in this run, by (node, role, room): what replay must reproduce."""
        prefill = {**self.finished_before_restart, **self.prefill.rooms}
        return {**{(self.prefill_id, "prefill", r): room for r, room in prefill.items()},
                **{(self.decode_id, "decode", r): room for r, room in self.decode.rooms.items()}}

    def _heartbeat(self) -> None:
        """The decode node's health check of the prefill node (SGLang: GET /health, N misses → node failure)."""
        self._heartbeat_armed = False
        self.missed_heartbeats = 0 if self.prefill_up else self.missed_heartbeats + 1
        if self.missed_heartbeats == self.config.heartbeat_max_failures:
            for room in self.decode.rooms.values():
                if not room.terminal:
                    self.decode.submit(room.room, "peer_failed",
                                       {"reason": f"{self.prefill_id} missed {self.missed_heartbeats} heartbeats"})
        busy = self.pending_arrivals or any(not r.terminal for r in self.decode.rooms.values())
        if busy or not self.prefill_up:
            self._arm_heartbeat()

    def _on_decode_success(self, room, decision, at) -> None:
        if decision.dst == "Success" and decision.src != "Success":
            self.clock.call_at(at + self.config.decode_time, lambda: self.release_pages(room.room, "finished"))

    # --- running ---
    def step_nodes(self) -> int:
        done = self.decode.step()
        if self.prefill_up:
            done += self.prefill.step()
        return done

    def run(self, until: float | None = None) -> None:
        """Process events and fire timers until nothing is left (or virtual time passes ``until``)."""
        while True:
            while self.step_nodes():
                pass
            nxt = self.clock.next_time()
            if nxt is None or (until is not None and nxt > until):
                return
            self.clock.fire_next()

    def close(self) -> None:
        for node in (self.prefill, self.decode):
            if node.journal is not None:
                node.journal.close()
