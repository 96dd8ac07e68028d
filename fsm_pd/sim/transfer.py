"""The simulated data plane: a transfer server per prefill instance (``PublishPort``) and a puller per decode
instance (``PullPort``), keeping the backend contract on the virtual clock.

A published entry is held until ``release``, ``fail`` or its hold expires; then its staging buffer is freed and a
tombstone makes later pulls fail at once. A pull connects (refused if no live server listens, or in a partition),
waits for the entry to be published up to its deadline (``TransferTimeout``), takes the bytes, and reports after a
local delay; that delay is where a pull can finish successfully after its room ended.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fsm_pd.sim.faults import FaultPlan
from fsm_pd.sim.kv import SimBuffer
from fsm_pd.sim.ledger import Ledger
from fsm_pd.sim.scheduler import Scheduler
from fsm_pd.transport.backends.base import OpenEntries, TransferFailed, TransferTimeout

BYTES_PER_S = 2.5e9
CONNECT_S = 0.0005
REPORT_S = 0.0002  # verify and place the pulled array
POLL_S = 0.005  # how often a pull looks again for an entry not yet published


class SimTransferServer:
    name = "sim"
    progressive = False

    def __init__(self, sched: Scheduler, ledger: Ledger, instance: Any, address: str):
        self.sched, self.ledger, self.instance, self._address = sched, ledger, instance, address
        self.entries: dict[int, SimBuffer] = {}
        self.tombstones: dict[int, str] = {}

    @property
    def address(self) -> str:
        return self._address

    def publish(self, uuid: int, staging: Any, hold_timeout_s: float) -> None:
        if uuid in self.entries or uuid in self.tombstones:
            raise ValueError(f"transfer uuid {uuid} was already used on {self._address}")
        (buf,) = staging
        self.entries[uuid] = buf
        self.ledger.alloc("entry", (self.instance.name, uuid), self.instance, buf.room)
        self.sched.later(hold_timeout_s, lambda: self._end(uuid, "hold expired"), self.instance, work=False)

    def release(self, uuid: int) -> None:
        self.ledger.free("entry", (self.instance.name, uuid), by="release")
        self._end(uuid, "released")

    def fail(self, uuid: int, reason: str) -> None:
        self.ledger.free("entry", (self.instance.name, uuid), by="fail")
        self._end(uuid, reason)

    def _end(self, uuid: int, reason: str) -> None:
        buf = self.entries.pop(uuid, None)
        self.tombstones.setdefault(uuid, reason)
        if buf is not None:  # the backend lets the staging buffer go with its entry
            self.ledger.free("staging", buf.key, by=f"the transfer entry ending ({reason})")

    def open_entries(self) -> OpenEntries:
        return OpenEntries(len(self.entries), sum(b.nbytes for b in self.entries.values()))


class SimPuller:
    def __init__(self, sched: Scheduler, ledger: Ledger, instance: Any, plan: FaultPlan,
                 servers: Callable[[str], SimTransferServer | None], partitioned: Callable[[], bool]):
        self.sched, self.ledger, self.instance, self.plan = sched, ledger, instance, plan
        self.servers, self.partitioned = servers, partitioned

    def pull(self, address: str, uuid: int, page_count: int, timeout_s: float, *, done: Callable,
             on_progress: Any = None, delay_s: float = 0.0, piece: Any = None) -> None:
        deadline = self.sched.clock.now() + timeout_s
        self.sched.later(delay_s + CONNECT_S, lambda: self._look(address, uuid, page_count, deadline, done),
                         self.instance)

    def _look(self, address: str, uuid: int, page_count: int, deadline: float, done: Callable) -> None:
        now = self.sched.clock.now()
        if now >= deadline:
            done(None, TransferTimeout(f"transfer {uuid} not pulled from {address} in time"))
            return
        server = self.servers(address)
        if server is None or not server.instance.alive or self.partitioned():
            done(None, TransferFailed(f"no live transfer server at {address}"))
            return
        if uuid in server.tombstones:
            done(None, TransferFailed(f"transfer {uuid}: {server.tombstones[uuid]}"))
            return
        entry = server.entries.get(uuid)
        if entry is None:  # not published (yet, or ever: a restarted server never heard of it)
            self.sched.later(min(POLL_S, deadline - now), lambda: self._look(address, uuid, page_count, deadline,
                                                                            done), self.instance)
            return
        if self.plan.pull_fails():
            done(None, TransferFailed("connection reset during the pull"))
            return
        wire_s = entry.nbytes / BYTES_PER_S
        if now + wire_s >= deadline:
            self.sched.later(deadline - now, lambda: done(None, TransferTimeout(f"transfer {uuid}: too slow")),
                             self.instance)
            return
        self.sched.later(wire_s, lambda: self._landed(entry, done), self.instance)

    def _landed(self, entry: SimBuffer, done: Callable) -> None:
        """Every byte is here: the pulled array exists on this node from now on, whatever the room does."""
        pulled = SimBuffer(self.ledger.new_id(), "pulled", entry.room, entry.rows, entry.nbytes // max(1, entry.rows))
        self.ledger.alloc("pulled", pulled.key, self.instance, pulled.room)
        self.sched.later(REPORT_S + self.plan.pull_reports_late(), lambda: done(pulled, None), self.instance)
