"""The ``pool`` transfer backend: a handoff between two engines that share one KV pool (``--role pd`` on one set of
devices). What P publishes is not KV but the list of its pages (``PageHandoff``); D's pull takes that list, and D's
"scatter" makes its room the pages' owner (``control/pool_kv.py``, ``PageAllocator.hand_over``). No byte moves.

Everything else is the ``device`` backend's contract, unchanged: the holds, tombstones and expiry, one delivery per
uuid, a pull that parks until its uuid is published and ends within ``timeout_s``, ``fail``. So the state machines,
the journal, the fault knobs and replay see the same handoff as between two processes.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

from fsm_pd.transport.backends.base import OnProgress, TransferFailed, check_uuid
from fsm_pd.transport.backends.device_backend import DeviceTransferBackend, node_at


@dataclass(frozen=True)
class PageHandoff:
    """The pages of one handoff, in order, in a pool both engines hold, and ``sender``: the room (its allocator key)
    that held them when P named them, which must still hold them when D adopts them (``PageAllocator.hand_over``).
    ``nbytes`` is what crossed: nothing."""

    pages: tuple[int, ...]
    nbytes: int = 0
    sender: object = None

    @property
    def shape(self) -> tuple[int, int]:  # (pieces, pages): what a publish reports as its rows
        return (1, len(self.pages))


class PoolHandoffBackend(DeviceTransferBackend):
    name = "pool"
    scheme = "pool://"

    def publish(self, uuid: int, staging: Sequence[PageHandoff], hold_timeout_s: float) -> None:
        handoffs = tuple(staging)
        if not handoffs or not all(isinstance(h, PageHandoff) for h in handoffs):
            raise TypeError("the pool backend publishes PageHandoff entries only (a shared pool's page lists)")
        with self._changed:
            self._holds.publish(uuid, 0, hold_timeout_s, lambda _deadline: handoffs)
            self._changed.notify_all()

    def pull_settled(self, address: str, uuid: int) -> tuple[PageHandoff, ...] | None:
        """``pull``'s outcome where it comes at once, in one look: the entry of a published ``uuid`` (its one
        delivery), or the error of an ended one or of no such node; None where ``pull`` would wait for the publish.
        (It asked whether the entry was settled, then pulled: the node, its lock and the hold looked up twice.)"""
        check_uuid(uuid)
        node = self._node(address)
        with node._changed:
            if node._published(uuid) is None:
                return None
            published = node._take(uuid, 0.0)
        with self._changed:
            self.pulls += 1
        return published

    def pull(self, address: str, uuid: int, spec, timeout_s: float,
             on_progress: OnProgress | None = None) -> tuple[PageHandoff, ...]:
        deadline = time.monotonic() + timeout_s
        check_uuid(uuid)
        published = self._node(address)._take(uuid, deadline)
        with self._changed:
            self.pulls += 1
        return published

    @staticmethod
    def _node(address: str) -> PoolHandoffBackend:
        node = node_at(address)
        if node is None or not isinstance(node, PoolHandoffBackend):
            raise TransferFailed(f"no pool handoff node at {address!r} (the pool backend hands pages over only "
                                 "between engines of one process that share one pool)")
        return node
