"""The simulated data plane: a transfer server per prefill instance (``PublishPort``) and a puller per decode
instance (``PullPort``), keeping the backend contract on the virtual clock.

The server's entries live in the production ``HoldTable`` (``fsm_pd.transport.backends.holds``), on the virtual
clock: held until ``release``, ``fail`` or its hold expires, then retired (the staging buffer is freed) and remembered
as a tombstone, so that a later pull fails at once, exactly as on the real backends. ``release`` and ``fail`` are
``HoldingBackend``'s own. Like the default ``tcp`` backend the server is progressive: an entry may be published
before it is filled (``publish_progressive``, the real ``StagingProgress``), and only final bytes leave.

A pull connects (refused if no live server listens, or in a partition), waits for the entry to be published up to
its deadline (``TransferTimeout``), then streams it a layer at a time: each layer leaves once P made it final and
lands after its wire time, and ``on_progress`` hears of it, as the tcp backend reports. A fault resets the
connection before the first layer or after a few (a streamed scatter then has written some of them); a server that
dies, ends the entry or is cut off fails the pull at the next layer. Once every byte is in, the pull reports after
a local delay; that delay is where a pull can finish successfully after its room ended.

In a shared pool (``shared_pool.py``) the server is the ``pool`` backend's: an entry is a page list
(``SimHandoff``), not bytes; a pull waits for it as any does, is not cut by a partition (both engines are one
process), takes it once (a second pull of the uuid fails, as ``PoolHandoffBackend``'s does) and reports it after the
local delay; a fault fails it, or names page 0 in the list it delivers (``SharedPoolKV.corrupt``'s fault).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from fsm_pd.sim.faults import FaultPlan
from fsm_pd.sim.kv import SimBuffer, SimPoolPages
from fsm_pd.sim.ledger import Ledger
from fsm_pd.sim.shared_pool import SimHandoff
from fsm_pd.sim.timeline import OwnedDeadlines, OwnedTimers, Timeline
from fsm_pd.transport.backends.base import StagingProgress, TransferFailed, TransferTimeout
from fsm_pd.transport.backends.holds import Hold, HoldingBackend, HoldTable
from fsm_pd.transport.reshard import piece_uuid

BYTES_PER_S = 2.5e9
CONNECT_S = 0.0005
REPORT_S = 0.0002  # verify and place the pulled array
POLL_S = 0.005  # how often a pull looks again for an entry not yet published


class SimTransferServer(HoldingBackend):
    """The publish half of a backend over the real ``HoldTable``; pulls are ``SimPuller``'s."""

    name = "sim"
    progressive = True
    sends_pages = True  # like tcp: an entry may be the pool's pages themselves (``publish_pages``)

    def __init__(self, sched: Timeline, ledger: Ledger, instance: Any, address: str, *, pool: bool = False):
        """``pool``: the ``pool`` backend of two engines sharing one pool (entries are page lists)."""
        self.sched, self.ledger, self.instance, self._address = sched, ledger, instance, address
        self._holds = HoldTable(self._retire, clock=OwnedDeadlines(OwnedTimers(sched.clock, instance)))
        self._waiting: dict[int, list[Callable[[], None]]] = {}  # uuid -> pulls waiting for more final bytes
        self.delivered: set[int] = set()  # the pool backend's: uuids pulled once (and awaiting release)
        if pool:
            self.name, self.progressive, self.sends_pages = "pool", False, False

    @property
    def address(self) -> str:
        return self._address

    def publish(self, uuid: int, staging: Any, hold_timeout_s: float) -> None:
        (buf,) = staging
        self._publish(uuid, buf, None, hold_timeout_s)

    def publish_progressive(self, uuid: int, host: SimBuffer, hold_timeout_s: float) -> StagingProgress:
        progress = StagingProgress(host, lambda: self._wake(uuid))
        self._publish(uuid, host, progress, hold_timeout_s)
        return progress

    def publish_pages(self, uuid: int, source: SimPoolPages, hold_timeout_s: float) -> None:
        """As the tcp backend's: the entry is the pool's pages, read while they are sent; they are the send's (a
        reader of each page) until the hold ends."""
        self._publish(uuid, source, None, hold_timeout_s)
        source.hold()

    def _publish(self, uuid: int, buf: SimBuffer | SimPoolPages, progress: StagingProgress | None,
                 hold_timeout_s: float) -> None:
        if buf.room is None:  # a chunk's piece of cached pages only, or a trailer: its room is the uuid's
            buf.room = self._room_of(uuid)
            if buf.key is not None:
                self.ledger.held[("staging", buf.key)].room = buf.room
        self._holds.publish(uuid, buf.nbytes, hold_timeout_s, lambda deadline: (buf, progress))
        self.ledger.alloc("entry", (self.instance.name, uuid), self.instance, buf.room)

    def _room_of(self, uuid: int) -> int | None:
        """The room whose handoff ``uuid`` is a piece of (the prefill handler's own record)."""
        for room, (base, pieces) in self.instance.effects.staging.items():
            if any(piece_uuid(base, index) == uuid for index in range(pieces)):
                return room
        return None

    def release(self, uuid: int) -> None:
        self.ledger.free("entry", (self.instance.name, uuid), by="release")
        super().release(uuid)

    def fail(self, uuid: int, reason: str) -> None:
        self.ledger.free("entry", (self.instance.name, uuid), by="fail")
        super().fail(uuid, reason)

    def _retire(self, uuid: int, reason: str, hold: Hold | None) -> None:
        self.delivered.discard(uuid)  # a later pull finds the tombstone
        if hold is not None:  # the backend lets the staging buffer go with its entry
            buf = hold.payload[0]
            if isinstance(buf, SimPoolPages):
                buf.let_go()  # the pages are no longer the send's: the room may free them
            else:
                self.ledger.free("staging", buf.key, by=f"the transfer entry ending ({reason})")
        self._wake(uuid)  # a pull waiting for bytes finds the tombstone

    def lookup(self, uuid: int) -> tuple[Any, str | None]:
        """What a pull finds: ``((buffer, progress or None), None)``, ``(None, why it ended)``, or ``(None, None)``
        if never published."""
        return self._holds.lookup(uuid)

    def wait_for_bytes(self, uuid: int, wake: Callable[[], None]) -> None:
        self._waiting.setdefault(uuid, []).append(wake)

    def _wake(self, uuid: int) -> None:
        for wake in self._waiting.pop(uuid, ()):
            wake()

    def died(self) -> None:
        """The process is gone: every stream it served breaks (the pullers see a reset)."""
        for uuid in list(self._waiting):
            self._wake(uuid)

    def pull(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError("pulls go through SimPuller")

    def close(self) -> None:
        self._holds.close()


class _Wire:
    """The bytes of a pull as they landed, for ``on_progress``: what the entry held when each layer was sent."""

    def __init__(self, entry: Any):
        self.room, self.nbytes, self.rows = entry.room, entry.nbytes, entry.rows
        self.content: list = list(entry.content)


@dataclass(eq=False)
class _Pull:
    address: str
    uuid: int
    deadline: float
    done: Callable[[Any, BaseException | None], None]
    on_progress: Callable[[int, Any, int], None] | None
    entry: SimBuffer | SimPoolPages | None = None
    progress: StagingProgress | None = None
    turn: Any = None  # a send from the pool: this stream's place in the pool's lease
    wire: Any = None  # what has landed so far (``_Wire``): the entry's content as it was sent, perhaps corrupted
    corrupt: bool = False  # a fault changes the bytes of this pull
    reset_at: int | None = None  # bytes after which a fault resets the connection
    received: int = 0


class SimPuller:
    def __init__(self, sched: Timeline, ledger: Ledger, instance: Any, plan: FaultPlan,
                 servers: Callable[[str], SimTransferServer | None], partitioned: Callable[[], bool], layers: int):
        """``layers``: a staging buffer streams in this many equal parts (the layout's layers)."""
        self.sched, self.ledger, self.instance, self.plan = sched, ledger, instance, plan
        self.servers, self.partitioned, self.layers = servers, partitioned, layers
        self.record: Callable[[str, int, str], None] | None = None  # World.record

    def pull(self, address: str, uuid: int, page_count: int, timeout_s: float, *, done: Callable,
             on_progress: Any = None, delay_s: float = 0.0, piece: Any = None) -> None:
        p = _Pull(address, uuid, self.sched.clock.now() + timeout_s, done, on_progress)
        self.sched.later(delay_s + CONNECT_S, lambda: self._look(p), self.instance)

    def _server(self, p: _Pull) -> SimTransferServer | None:
        server = self.servers(p.address)
        if server is None or not server.instance.alive or self.partitioned():
            return None
        return server

    def _stalled(self, p: _Pull, again: Callable[[_Pull], None]) -> bool:
        """P's process is stalled (SIGSTOP): its socket accepts, nothing answers; try again when it resumes, or
        time out at the pull's deadline, as a blocked socket read does."""
        server = self.servers(p.address)
        if server is None or not server.instance.frozen():
            return False
        now = self.sched.clock.now()
        if now >= p.deadline:
            p.done(None, TransferTimeout(f"transfer {p.uuid}: {p.address} did not answer in time"))
        else:
            self.sched.later(min(server.instance.frozen_until, p.deadline) - now, lambda: again(p), self.instance)
        return True

    def _look(self, p: _Pull) -> None:
        now = self.sched.clock.now()
        if now >= p.deadline:
            p.done(None, TransferTimeout(f"transfer {p.uuid} not pulled from {p.address} in time"))
            return
        if self._stalled(p, self._look):
            return
        server = self._server(p)
        if server is None:
            p.done(None, TransferFailed(f"no live transfer server at {p.address}"))
            return
        found, ended = server.lookup(p.uuid)
        if ended is not None:
            p.done(None, TransferFailed(f"transfer {p.uuid}: {ended}"))
            return
        if found is None:  # not published (yet, or ever: a restarted server never heard of it)
            self.sched.later(min(POLL_S, p.deadline - now), lambda: self._look(p), self.instance)
            return
        p.entry, p.progress = found
        if isinstance(p.entry, SimHandoff):
            self._take_pages(p, server)
            return
        if isinstance(p.entry, SimPoolPages):
            p.turn = p.entry.reader()
        p.wire = _Wire(p.entry)
        p.corrupt = bool(p.entry.content) and self.plan.pull_corrupts()
        reset_after = self.plan.pull_breaks_after(self.layers)
        if reset_after is not None:
            p.reset_at = reset_after * (p.entry.nbytes // self.layers)
        self._stream(p)

    def _stream(self, p: _Pull) -> None:
        """Send the next layer that is final, or wait until P makes one final."""
        if self._stalled(p, self._stream):
            return
        now, total = self.sched.clock.now(), p.entry.nbytes
        server = self._server(p)
        found, ended = (None, "the server went away") if server is None else server.lookup(p.uuid)
        if found is None and p.received < total:
            p.done(None, TransferFailed(f"transfer {p.uuid} broke off after {p.received} of {total} bytes: {ended}"))
            return
        if p.reset_at is not None and p.received >= p.reset_at:
            if self.record is not None:
                self.record("pull reset", p.entry.room, f"transfer {p.uuid} reset after {p.received} bytes")
            p.done(None, TransferFailed("connection reset during the pull"))
            return
        if p.received >= total:
            self._landed(p)
            return
        final = total if p.progress is None else p.progress.final_bytes
        if p.received >= final:  # P has not gathered the next layer yet
            server.wait_for_bytes(p.uuid, lambda: self.sched.later(0.0, lambda: self._stream(p), self.instance))
            return
        layer = total // self.layers
        upto = min(final, (p.received // layer + 1) * layer)
        wire_s = (upto - p.received) / BYTES_PER_S
        if now + wire_s >= p.deadline:
            self.sched.later(p.deadline - now, lambda: p.done(None, TransferTimeout(f"transfer {p.uuid}: too slow")),
                             self.instance)
            return
        if p.turn is not None:  # P sends this layer from its pool's pages, now
            p.entry.read(p.turn, p.received, upto)
        self.sched.later(wire_s, lambda: self._arrived(p, upto), self.instance)

    def _arrived(self, p: _Pull, upto: int) -> None:
        p.received = upto
        p.wire.content = list(p.entry.content)
        if p.corrupt:  # a page's bytes changed on the way; the tags say so, and D's checksum will hash them
            p.wire.content[0] = f"corrupted ({p.entry.content[0]})"
        if p.on_progress is not None:
            p.on_progress(0, p.wire, upto)
        self._stream(p)

    def _take_pages(self, p: _Pull, server: SimTransferServer) -> None:
        """The pool backend's pull: the page list is delivered once; no byte moves."""
        if p.uuid in server.delivered:
            p.done(None, TransferFailed(f"transfer {p.uuid} was already pulled and awaits release"))
            return
        if self.plan.pull_fails():
            p.done(None, TransferFailed("the pull failed"))
            return
        server.delivered.add(p.uuid)
        entry = p.entry
        pages = entry.pages
        if self.plan.pull_corrupts():
            pages = entry.corrupted()
            if self.record is not None:
                self.record("corrupt", entry.room, f"transfer {p.uuid} delivered a page list naming page 0")
        handed = SimHandoff(self.ledger.new_id(), "pulled", entry.room, pages, entry.sender)
        self.ledger.alloc("pulled", handed.key, self.instance, handed.room)
        self.sched.later(REPORT_S + self.plan.pull_reports_late(), lambda: p.done(handed, None), self.instance)

    def _landed(self, p: _Pull) -> None:
        """Every byte is here: the pulled array exists on this node from now on, whatever the room does."""
        entry = p.entry
        pulled = SimBuffer(self.ledger.new_id(), "pulled", entry.room, entry.rows, entry.nbytes // max(1, entry.rows),
                           words=getattr(entry, "words", None), corrupt=entry.corrupt)
        pulled.content = tuple(p.wire.content)
        if p.corrupt and self.record is not None:
            self.record("corrupt", entry.room, f"a byte of transfer {p.uuid} flipped on the wire")
        self.ledger.alloc("pulled", pulled.key, self.instance, pulled.room)
        late = self.plan.pull_reports_late()
        if late and self.record is not None:
            self.record("late pull report", entry.room, f"transfer {p.uuid} reported {late:.3f} s late")
        self.sched.later(REPORT_S + late, lambda: p.done(pulled, None), self.instance)
