"""The local path of a PD node: a request the router sent here whole (``fsm_pd_route`` local, ``router/policy.py``),
prefilled and decoded on this node, with no room and no transfer. A decode node always serves it; a prefill node
with ``--serve-local`` does too (a node that serves both roles: ``docs/serving.md``, "No idle core").

The request takes the path a failed transfer's recompute takes on a decode node (``recompute.py``): its pages under
the key ``-(room + 1)`` (never a room's, so no room's ``FreePages`` can touch them), the recompute's queue and
prefill (``forward.prefill_step``, chunk by chunk between decode steps: the request's seed, step 0, so its tokens
are the ones a PD run gives), then the node's decode loop. Once its prefill ran the node journals one row for it,
role ``local`` (``Node.record``, replayed as a record by ``store/replay.py``), with the router's reason;
``meta_info.pd_route`` is its receipt.

A mixin for ``PDEngine`` subclasses that own ``self.recompute`` (a ``TransferRecompute``) and a decode loop, and
call ``_take_local`` on the arrivals of each step and ``_local_ended`` when a local request ends.
"""

from __future__ import annotations

import threading
from collections import deque

from fsm_pd.serving.common import check_request
from fsm_pd.serving.recompute import recompute_key
from fsm_pd.serving.sequence import Sequence
from fsm_pd.serving.types import EngineError, GenerateRequest
from fsm_pd.store.roles import LOCAL_ROLE  # the journal role of a request a node prefilled itself (a record)


def is_local(request: GenerateRequest) -> bool:
    return request.bootstrap is not None and request.bootstrap.local


class LocalPath:
    serves_local = True  # a prefill node says False unless started with --serve-local

    def _init_local(self) -> None:
        self.recompute.on_local = self._journal_local
        self._local_rooms: set[int] = set()  # live local requests' rooms: a second one with the same room is refused
        # ended ones whose journal row may still wait in the node loop's inbox (not yet where has_room looks), oldest
        # first: rows are journaled in order, so those the journal has are pruned from the left
        self._local_recorded: deque[int] = deque()
        self._local_lock = threading.Lock()

    # --- any thread ---
    def _check(self, request: GenerateRequest) -> None:
        if not is_local(request):
            super()._check(request)
            return
        if not self.serves_local:
            raise EngineError(f"request {request.rid}: this {self.role} node does not serve requests whole "
                              "(fsm_pd_route local); start it with --serve-local", 400)
        # it decodes here: prompt plus max_new_tokens must fit this node's pool, as on a decode node; nothing crosses
        # to a peer, so a handoff's limits (the READY frame's top logprobs) do not apply
        check_request(request, self.max_context, needs_bootstrap=False, pool_tokens=self.pool_tokens)

    def _key(self, request: GenerateRequest) -> int:
        # no room with the KV manager: the recompute's key, negative, so no room's FreePages can touch its pages
        room = request.bootstrap.room
        return recompute_key(room) if request.bootstrap.local else room

    def _accept(self, seq: Sequence) -> None:
        if not is_local(seq.request):
            super()._accept(seq)
            return
        room = seq.request.bootstrap.room
        with self._local_lock:
            journal = self.manager.journal
            while self._local_recorded and journal.has_room(self.node_id, LOCAL_ROLE, self._local_recorded[0]):
                self._local_recorded.popleft()
            if room in self._local_rooms or room in self._local_recorded or journal.has_room(self.node_id,
                                                                                              LOCAL_ROLE, room):
                raise EngineError(f"request {seq.rid}: bootstrap_room {room} was already used for a local prefill "
                                  f"on {self.node_id}; a room is used once", 409)
            self._local_rooms.add(room)
        seq.meta["pd_route"] = {"path": "local", "reason": (seq.request.route or {}).get("reason", ""),
                                "prefill": None, "pages": 0, "bytes": 0, "node": self.node_id}

    def _on_cancel(self, seq: Sequence, reason: str) -> None:
        if not is_local(seq.request):
            super()._on_cancel(seq, reason)
            return
        # a local request has no room to abort: the scheduler drops it, unprefilled (not journaled), or finishes it
        if "local_prefill_seconds" not in seq.meta["pd_route"]:
            self._forget_local(seq)

    # --- the model thread ---
    def _take_local(self, arrived: list[Sequence]) -> list[Sequence]:
        """Queue this step's local arrivals for their prefill (out of ``rooms``: they have none); returns the
        others."""
        others = []
        for seq in arrived:
            if is_local(seq.request):
                self.rooms.pop(seq.key, None)
                self.recompute.start_local(seq)
            else:
                others.append(seq)
        return others

    def _local_ended(self, seq: Sequence) -> None:
        """A request this node prefilled itself ended: its pages go back."""
        self.recompute.release(seq)
        if is_local(seq.request):
            self._forget_local(seq, recorded="local_prefill_seconds" in seq.meta["pd_route"])

    def _forget_local(self, seq: Sequence, recorded: bool = False) -> None:
        """``recorded``: its journal row was queued; until the journal has it, its room is refused from here."""
        room = seq.request.bootstrap.room
        with self._local_lock:
            self._local_rooms.discard(room)
            if recorded:
                self._local_recorded.append(room)

    def _journal_local(self, seq: Sequence, failed: Exception | None) -> None:
        """One ``local`` row in the journal once the prefill ran, with the router's reason: what ``replay
        --request`` shows for this attempt."""
        event = {"rid": seq.rid, "route": (seq.request.route or {}).get("reason", ""), "prompt_len": seq.prompt_len,
                 "seconds": seq.meta["pd_route"].get("local_prefill_seconds")}
        self.manager.node.record(LOCAL_ROLE, seq.request.bootstrap.room, "local_prefill",
                                 "Failed" if failed else "Success", event,
                                 reason=f"local prefill failed: {failed}" if failed else None)
