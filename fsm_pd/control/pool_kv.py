"""``SharedPoolKV``: the KV ports of two engines that share one pool (``--role pd`` on one set of devices).

A handoff there moves page ownership, not bytes. P's "gather" names the pages its room holds (``PageHandoff``); the
``pool`` backend hands that list to D's pull; D's "scatter" makes D's room their owner in one step under the
allocator's lock (``PageAllocator.hand_over``), and the pages D had reserved for the prompt go back to the free list.

What guards a page reused mid-handoff, where a checksum has nothing to check: ownership. P's gather names the room
that holds the pages (``PageAllocator.holder``: its key in the allocator, which no later room takes) as the handoff's
``sender``. Between P's publish and D's adoption the pages stay that room's; they leave it only by the hand-over, which
first checks that the sender still holds every one of them (and D's room every page it gives back). If P's room ended
meanwhile (a deadline, an abort) its ``FreePages`` returned the pages, and the hand-over fails, even where another
room has reserved them since and holds them all (with its own KV); D's room fails and D recomputes the request. A
page is never owned by two rooms, and none is freed while it moves.

Neither job waits for the model thread (``on_model_thread``, ``effects/ports.run_kv_job``): both run on their engine's
loop thread the moment the machine asks, since neither touches the pool's arrays. That is safe for the device too:
P's room reaches ``kv_ready`` only after the model thread dispatched its last prefill program, and D's first decode
step that reads the pages is dispatched by the same thread after the hand-over, so the chip sees them in order.
"""

from __future__ import annotations

from typing import Any

from fsm_pd.control.jax_kv import JaxKV
from fsm_pd.transport.backends.pool_backend import PageHandoff
from fsm_pd.transport.reshard import ReshardPlan


class SharedPoolKV(JaxKV):
    # a handoff's gather names pages and its scatter moves their ownership under the allocator's lock: neither
    # touches the pool's arrays, so neither waits behind a model step (effects/ports.py, run_kv_job)
    on_model_thread = False

    def __init__(self, layout, model, *, allocator: Any, **options: Any) -> None:
        """``allocator``: the ``PageAllocator`` both engines' views share (``PageAllocator.view``)."""
        super().__init__(layout, model, progressive=False, **options)
        self.allocator = allocator

    # --- prefill ---
    def gather(self, owner: Any, pages: list[int], plan: ReshardPlan) -> tuple[PageHandoff, ...]:
        return (PageHandoff(tuple(pages), sender=self.allocator.holder(pages)),)

    def gathers_progressively(self, owner: Any) -> bool:
        return False

    @property
    def summed(self) -> bool:
        return False  # no byte moves, so there is nothing to sum: ownership is the guard (module doc)

    # --- decode ---
    def pull_spec(self, page_count: int, piece: Any = None) -> tuple[None]:
        """Nothing to shape-check: the ``pool`` backend's pull returns P's page list, never an array. A jax
        ``ShapeDtypeStruct`` built for every pull anyway was a tenth of D's share of a handoff."""
        return (None,)

    def scatter(self, owner: Any, pieces: tuple, pages: list[int], stream: Any, plan: ReshardPlan) -> list[int]:
        """Adopt the pages P's room holds in place of ``pages`` (what D reserved for them); returns the adopted."""
        (handoff,) = pieces
        if len(handoff.pages) != len(pages):
            raise ValueError(f"the prefill side hands over {len(handoff.pages)} pages for {len(pages)} reserved")
        self.allocator.hand_over(list(handoff.pages), list(pages), sender=handoff.sender)
        return list(handoff.pages)

    def corrupt(self, staging: PageHandoff) -> PageHandoff:
        """``FSM_PD_FAULT_CORRUPT_PULL``: a list whose first page is the reserved page 0, which no room holds, so
        the hand-over refuses it as a page reused mid-handoff would be."""
        return PageHandoff((0, *staging.pages[1:]), sender=staging.sender)
