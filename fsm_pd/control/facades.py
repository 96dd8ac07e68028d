"""SGLang's PD roles as thin facades over ``KVManager``: ``KVSender`` (prefill) and ``KVReceiver`` (decode).

They keep SGLang's method names and call order, so a scheduler written against ``BaseKVSender`` and
``BaseKVReceiver`` drives fsm-pd's machines. ``poll()`` reads the journaled state and never advances anything: the
machines move on events (messages, effect results, deadlines), not on being polled.
"""

from __future__ import annotations

from collections.abc import Sequence

from fsm_pd.control.manager import KVManager
from fsm_pd.machines import KVPoll


class KVTransferError(Exception):
    """A transfer failed; ``reason`` is the journaled one (``fsm-pd replay`` shows the whole story)."""

    def __init__(self, bootstrap_room: int, reason: str):
        super().__init__(f"KV transfer of room {bootstrap_room} failed: {reason}")
        self.bootstrap_room = bootstrap_room
        self.reason = reason


class _Facade:
    def __init__(self, mgr: KVManager, bootstrap_addr: str | None, bootstrap_room: int):
        self.mgr, self.bootstrap_addr, self.bootstrap_room = mgr, bootstrap_addr, int(bootstrap_room)

    def poll(self) -> KVPoll:
        state = self.mgr.poll(self.bootstrap_room)
        return KVPoll.Bootstrapping if state is None else state  # created but not journaled yet

    def failure_exception(self) -> None:
        raise KVTransferError(self.bootstrap_room, self.mgr.reason(self.bootstrap_room) or "unknown reason")

    def abort(self, reason: str = "aborted by the scheduler") -> None:
        self.mgr.abort(self.bootstrap_room, reason)

    def clear(self) -> None:
        if self.poll() in (KVPoll.Success, KVPoll.Failed):
            self.mgr.clear(self.bootstrap_room)


class KVSender(_Facade):
    """Prefill side. ``init(num_kv_indices)``, then ``send(page_ids)`` per chunk; the chunk that completes the page
    count is the last and starts the transfer."""

    def __init__(self, mgr: KVManager, bootstrap_addr: str | None, bootstrap_room: int, *_, **__):
        super().__init__(mgr, bootstrap_addr, bootstrap_room)
        self.num_kv_indices: int | None = None
        self._pages: list[int] = []
        mgr.add_sender(self.bootstrap_room)

    def init(self, num_kv_indices: int, aux_index: int | None = None) -> None:
        if num_kv_indices < 1:
            raise ValueError("fsm-pd transfers at least one page (decode prefix caching is not supported)")
        self.num_kv_indices = int(num_kv_indices)

    def pop_decode_prefix_len(self) -> int:
        return 0

    def should_send_kv_chunk(self, num_pages: int, last_chunk: bool) -> bool:
        return num_pages > 0

    def send(self, kv_indices: Sequence[int], state_indices=None, num_kv_tokens=None, *, first_token: int = 0,
             first_logprob: float | None = None, input_logprobs: list[float] | None = None) -> None:
        if self.num_kv_indices is None:
            raise RuntimeError("KVSender.send before init: the page count is not known")
        self._pages.extend(int(i) for i in kv_indices)
        if len(self._pages) > self.num_kv_indices:
            raise ValueError(f"sent {len(self._pages)} pages, more than the {self.num_kv_indices} announced")
        if len(self._pages) == self.num_kv_indices:
            self.mgr.kv_ready(self.bootstrap_room, pages=self._pages, first_token=first_token,
                              first_logprob=first_logprob, input_logprobs=input_logprobs)


class KVReceiver(_Facade):
    """Decode side. ``init(prefill_dp_rank)`` finds the prefill node; ``send_metadata(page_ids)`` hands over the
    pages this node allocated for the request (with ``SchedulerAdmission``)."""

    def __init__(self, mgr: KVManager, bootstrap_addr: str | None, bootstrap_room: int, *_, **__):
        super().__init__(mgr, bootstrap_addr, bootstrap_room)

    def init(self, prefill_dp_rank: int = 0, *, page_count: int | None = None, prompt_len: int = 0) -> None:
        where = {"prefill_dp_rank": int(prefill_dp_rank)}
        if self.bootstrap_addr is not None:
            where["bootstrap_addr"] = self.bootstrap_addr
        self.mgr.add_receiver(self.bootstrap_room, page_count=page_count, prompt_len=prompt_len, **where)

    def send_metadata(self, kv_indices: Sequence[int], aux_index=None, state_indices=None,
                      decode_prefix_len=None) -> None:
        self.mgr.give_pages(self.bootstrap_room, list(kv_indices))
