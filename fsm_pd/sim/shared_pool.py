"""The shared-pool mode: ``--role pd`` on one set of devices, where the prefill and the decode engine run in one
process over one KV pool, one page allocator and one model thread, and a handoff moves page ownership instead of
bytes (``control/pool_kv.py``, ``transport/backends/pool_backend.py``, ``PageAllocator.hand_over``).

What runs is production code as elsewhere in the simulation: the handlers (P's gather and publish, D's pull, its
scatter that journals the adopted pages with 0 bytes), the machines, the engines' admission over the real
``PageAllocator``, each engine seeing it through the production ``AllocatorView`` (rooms keyed ``(role, room)``),
and the allocator's own ``hand_over``. Simulated are the ports below them, as for every other mode: the KV port
(``SimPoolKV``: P's gather names its room's pages, D's scatter calls the allocator's ``hand_over``, as
``SharedPoolKV`` does; that module loads jax), the pool backend (``transfer.py``: the page list is published and
delivered once, held until released, failed or expired), and the one model thread both engines' jobs queue on.

One process: a crash or a stall of either role is one of both (``World``), and a restart starts both with a new
pool. The checks (``RecordingAllocator``): every adopted page was written by the prefill room of the receiving
room's id and is no longer its own; it is the receiver's alone; what the receiver gave back is free; a room frees
only pages it holds (none that another adopted); and, once quiet, every page is free, one room's or cached.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from fsm_pd.kvpool.pages import AllocatorView
from fsm_pd.sim.allocator import RecordingAllocator
from fsm_pd.sim.ledger import Ledger
from fsm_pd.sim.model import SimModel

if TYPE_CHECKING:
    from fsm_pd.sim.world import World


class SharedProcess:
    """What the two engines of one ``--role pd`` process share: the pool's allocator and the model thread."""

    def __init__(self, world: World, first: Any):
        self.allocator = RecordingAllocator(world.shared_pages, world.ledger, first)
        self.model = SimModel(world.sched, first, lambda: world.model_delay)  # dies with the process: with both

    def view(self, role: str, instance: Any) -> RecordingView:
        self.allocator.members[role] = instance
        return RecordingView(self.allocator, role)


class RecordingView(AllocatorView):
    """An engine's production ``AllocatorView`` of the shared ``RecordingAllocator`` (which records and checks what
    the view forwards under the role's keys), plus the simulation's own calls on the allocator under the same keys.
    Content tags stay plain room ids: what a page holds is a request's KV, whichever role holds the page."""

    shared: RecordingAllocator

    def use(self, pages: tuple[int, ...], room: int) -> None:
        self.shared.use(pages, self._key(room))

    def unuse(self, pages: tuple[int, ...], room: int) -> None:
        self.shared.unuse(pages, self._key(room))

    def begin(self, pages: list[int] | tuple[int, ...], who: str) -> None:
        self.shared.begin(pages, who)

    def end(self, pages: list[int] | tuple[int, ...], who: str) -> None:
        self.shared.end(pages, who)

    def wrote(self, room: int, pages: list[int] | tuple[int, ...]) -> None:
        self.shared.wrote(room, pages)

    def check_read(self, room: int, pages: list[int] | tuple[int, ...], what: str) -> bool:
        return self.shared.check_read(self._key(room), pages, what)

    def check_write(self, room: int, pages: list[int], what: str, content: tuple = (), transfer: bool = True,
                    writer: str | None = None) -> None:
        self.shared.check_write(self._key(room), pages, what, content, transfer, writer)

    def accounting(self) -> list[str]:
        return self.shared.accounting()

    busy = property(lambda self: self.shared.busy)
    last_writer = property(lambda self: self.shared.last_writer)


class SimHandoff:
    """``PageHandoff`` as the handlers see it (``pool_backend.py`` loads jax): the pages of one handoff, in order, in
    the pool both engines hold, and the room that held them when P named them (``sender``); no byte in it. A ledger
    entry like a staging or pulled buffer, so that each is let go exactly once."""

    __slots__ = ("key", "kind", "pages", "room", "sender")
    nbytes = 0  # what crosses: nothing

    def __init__(self, key: int, kind: str, room: int | None, pages: tuple[int, ...], sender: object):
        self.key, self.kind, self.room, self.pages, self.sender = key, kind, room, tuple(pages), sender

    @property
    def rows(self) -> int:
        return len(self.pages)

    @property
    def shape(self) -> tuple[int, int]:
        return (1, len(self.pages))

    def corrupted(self) -> tuple[int, ...]:
        """The list ``SharedPoolKV.corrupt`` makes (``FSM_PD_FAULT_CORRUPT_PULL``): page 0 first, which no room
        holds, so the hand-over refuses it as it would a page reused mid-handoff."""
        return (0, *self.pages[1:])

    def __repr__(self) -> str:
        return f"{self.kind} handoff #{self.key} of room {self.room}: pages {list(self.pages[:4])}..."


class SimPoolKV:
    """The ``PrefillKV`` and ``DecodeKV`` port of an engine in a shared pool, as ``SharedPoolKV`` is: no checksum
    (no byte moves), no layer streaming, a gather that names the room's pages and a scatter that adopts them."""

    summed = False
    checksum_algorithm = None
    on_model_thread = False  # as SharedPoolKV: its handoff jobs run where they are asked

    def __init__(self, ledger: Ledger, instance: Any, allocator: RecordingAllocator):
        self.ledger, self.instance, self.allocator = ledger, instance, allocator

    # --- prefill ---
    def gather(self, owner: Any, pages: list[int], plan: Any) -> tuple[SimHandoff]:
        """The pages and their holder (the allocator's own ``holder``, as ``SharedPoolKV.gather`` names it), read as
        far as a gather reads: each must be the room's, its KV final."""
        sender = self.allocator.holder(pages)
        room = sender[1] if isinstance(sender, tuple) and sender[0] == "prefill" else None
        if room is not None:
            self.allocator.check_read(sender, pages, "a gather")
        handoff = SimHandoff(self.ledger.new_id(), "staging", room, tuple(pages), sender)
        self.ledger.alloc("staging", handoff.key, self.instance, room)
        return (handoff,)

    def gathers_progressively(self, owner: Any) -> bool:
        return False

    def discard(self, staging: SimHandoff) -> None:
        self.ledger.free(staging.kind, staging.key, by="the handler discarding it")

    # --- decode ---
    def stream(self, pages: list[int]) -> None:
        return None

    def scatter(self, owner: Any, pieces: tuple, pages: list[int], stream: Any, plan: Any) -> list[int]:
        """As ``SharedPoolKV.scatter``: adopt the pages P's room holds in place of ``pages`` (what D reserved), by
        the allocator's own ``hand_over``; returns the adopted pages."""
        (handoff,) = pieces
        if len(handoff.pages) != len(pages):
            raise ValueError(f"the prefill side hands over {len(handoff.pages)} pages for {len(pages)} reserved")
        self.allocator.hand_over(list(handoff.pages), list(pages), sender=handoff.sender)
        return list(handoff.pages)

    def corrupt(self, staging: SimHandoff) -> SimHandoff:
        staging.pages = staging.corrupted()
        return staging
