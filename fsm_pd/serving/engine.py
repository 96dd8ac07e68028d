"""``EngineCore``: what the prefill, decode and colocated engines share, and the thread rules they keep.

An engine owns a model, a KV pool on its model thread, a page allocator and the table of live requests. The rules
(``docs/threads.md``):

- **Any thread** (the HTTP event loop, mostly) may call ``submit``, ``abort``, ``health``, ``info`` and
  ``flush_cache``. They only check, record in the thread-safe ``RequestTable``, queue, and kick the scheduler: a new
  request goes on ``arrivals``, a cancelled one is marked and left for the scheduler to drop.
- **The model thread** runs ``_step`` (one scheduler step, queued by ``StepDriver``), and alone reads and changes
  the scheduler's queues, the pool and the page reservations; ``arrivals`` reach it only through ``_step``.
- When the model thread dies (or, on a PD node, the KV manager's loop stops), ``health`` says why and every live
  request ends with a 503 at once (``_cannot_serve``).

A role adds only what is its own: ``_check`` (what a request must carry there), ``_accept`` (what ``submit`` does
past the common checks), ``_on_cancel`` (what an abort tells others), ``_step``, and its ``info`` fields.
"""

from __future__ import annotations

import time
from collections import deque

from prometheus_client import CollectorRegistry

from fsm_pd.kvpool.pages import AllocatorView, PageAllocator
from fsm_pd.kvpool.prefix_cache import PrefixCache
from fsm_pd.model.loader import LoadedModel, load_model
from fsm_pd.model.model_thread import ModelThread
from fsm_pd.scheduling.page_admission import flush_when_idle
from fsm_pd.serving.cache_metrics import PrefillCollector
from fsm_pd.serving.common import max_context_for, pool_tokens_for, refuse_if_unhealthy
from fsm_pd.serving.request_phases import RequestPhases
from fsm_pd.serving.request_table import ABORTED_STATUS, RequestTable
from fsm_pd.serving.sequence import Sequence
from fsm_pd.serving.shared_pool import SharedPool
from fsm_pd.serving.step_driver import StepDriver
from fsm_pd.serving.types import EngineError, GenerateRequest, RequestStream

FLUSH_TIMEOUT_S = 30.0


class EngineCore:
    role = "?"

    def __init__(self, model: LoadedModel | str, *, num_pages: int, page_size: int, name: str,
                 prefix_cache: bool = False, shared: SharedPool | None = None):
        """``prefix_cache``: keep finished prompts' pages in a ``PrefixCache`` and reuse their longest cached prefix
        (SGLang's radix cache). ``shared``: the pool, model thread, allocator and step loop this engine shares with
        the other role's (``shared_pool.py``); its own ``num_pages`` and ``page_size`` are then the shared pool's."""
        self.model = load_model(model) if isinstance(model, str) else model
        self.model_name = self.model.name
        self.shared = shared
        if shared is not None:
            num_pages, page_size = shared.num_pages, shared.page_size
        self.page_size = page_size
        self.max_context = max_context_for(self.model, num_pages, page_size)
        self.pool_tokens = pool_tokens_for(num_pages, page_size)
        if shared is None:
            self.layout = self.model.make_kv_layout(num_pages, page_size)
            self.model_thread = ModelThread(self.model.make_pool(self.layout), name=f"model[{name}]",
                                            device=self.model.device)
            self.allocator: PageAllocator | AllocatorView = PageAllocator(num_pages)
        else:
            self.layout, self.model_thread = shared.layout, shared.model_thread
            self.allocator = shared.allocator.view(self.role)
        self.cache = PrefixCache(self.allocator, page_size) if prefix_cache else None
        self.prefill_tokens = {"prefill_computed_tokens": 0, "prefill_cached_tokens": 0}  # the model thread's
        self.requests = RequestTable()
        self.registry = CollectorRegistry()  # this engine's /metrics (create_app reads ``registries``)
        self.registries = [self.registry]
        self.registry.register(PrefillCollector(self.prefill_counters, {"role": self.role, "node": name}))
        self.phases = RequestPhases(self.registry, self.role, name)
        self.arrivals: deque[Sequence] = deque()  # appended by submit (any thread), taken by _step (model thread)
        self._driver = (StepDriver(self.model_thread, self._step, name=f"{name} scheduler") if shared is None
                        else shared.member(self.role, self._step, engine=self))
        self.model_thread.on_death.append(self._cannot_serve)

    # --- any thread ---
    def submit(self, request: GenerateRequest, stream: RequestStream) -> None:
        refuse_if_unhealthy(self.health())
        self._check(request)
        seq = Sequence.start(request, stream, key=self._key(request), pages=[], tokenizer=self.model.tokenizer,
                             eos_token_ids=self.model.eos_token_ids, max_context=self.max_context)
        self.requests.add(seq)
        seq.accepting = True
        self.arrivals.append(seq)  # before _accept: its room's events must find it queued (``_arrived``)
        try:
            self._accept(seq)
        except BaseException:
            seq.cancelled = True  # the scheduler drops it from arrivals
            self.requests.pop(seq)
            raise
        finally:
            seq.accepting = False
            self._driver.kick()

    def abort(self, rid: str, reason: str | None = None, status: int = ABORTED_STATUS, *,
              room: int | None = None) -> bool:
        """Stop the request and free what it holds; False if unknown or finished. ``room`` None: every live request
        of ``rid``; a room: only that attempt, refused later if it has not arrived yet (``RequestTable``).
        ``reason`` (journaled, and in the stream's error) and ``status`` default to a client's abort (499); a drain
        passes its own."""
        seqs = self.requests.cancel(rid, room, reason or "aborted", status)
        for seq in seqs:
            self._on_cancel(seq, reason or "aborted")
        if seqs:
            self._driver.kick()
        return bool(seqs)

    def health(self) -> str | None:
        """Why this node cannot serve, or None: ``/health``."""
        return self.model_thread.health()

    def info(self) -> dict:
        """``pages_free`` counts the prefix cache's unlocked pages (a reservation takes them); ``pages_cached`` says
        how many of all pages the cache holds."""
        return {"role": self.role, "model": self.model_name, "max_context": self.max_context,
                "page_size": self.page_size, "tp_size": self.model.tp_size, "pages_free": self.allocator.free_pages,
                "pages_reserved": self.allocator.reserved_pages, "pages_cached": self.allocator.cached_pages,
                "requests_live": len(self.requests), "step_loop": self._driver.timing(), **self.prefill_counters()}

    def prefill_counters(self) -> dict:
        return {**self.prefill_tokens, **(self.cache.counters() if self.cache is not None else {})}

    def flush_cache(self) -> tuple[bool, str]:
        """SGLang's ``/flush_cache`` (see ``page_admission.flush_when_idle``); runs on the model thread."""
        return self.model_thread.call(
            lambda _owner: flush_when_idle(self.allocator, len(self.requests), self.cache), FLUSH_TIMEOUT_S)

    def close(self) -> None:
        self._driver.close()
        self._close_parts()
        if self.shared is None or self.shared.close_member():  # a shared model thread stops with its last engine
            self.model_thread.close()

    def _cannot_serve(self, reason: str) -> None:
        """The model thread (or the manager's loop) is gone: nothing in flight can finish, so every request ends."""
        self.requests.fail_all(EngineError(f"this {self.role} node cannot serve: {reason}", 503))

    # --- what a role adds ---
    def _check(self, request: GenerateRequest) -> None:
        """Raise ``EngineError(4xx)`` for a request this role can never serve."""
        raise NotImplementedError

    def _key(self, request: GenerateRequest) -> int:
        """The request's key in the allocator (and, on a PD node, its room)."""
        raise NotImplementedError

    def _accept(self, seq: Sequence) -> None:
        """What ``submit`` does once the request is recorded and queued (any thread); may raise ``EngineError``."""

    def _on_cancel(self, seq: Sequence, reason: str) -> None:
        """An abort of a live request (any thread): tell whoever else holds part of it."""

    def _close_parts(self) -> None:
        """Close what the role added, before the model thread stops."""

    def _step(self) -> bool:
        """One scheduler step (model thread); True while another step can make progress."""
        raise NotImplementedError

    def _prefilling(self, chunks) -> None:
        """Count a prefill step's computed prompt tokens, and the cached ones of the prompts it starts; time the
        queue of the prompts it starts."""
        now = time.monotonic()
        for chunk in chunks:
            self.prefill_tokens["prefill_computed_tokens"] += chunk.length
            if chunk.start == chunk.seq.prefix.tokens:
                self.prefill_tokens["prefill_cached_tokens"] += chunk.start
                chunk.seq.prefill_started = now
                self.phases.observe("queue", now - chunk.seq.queued_at)

    def _prefilled(self, seq: Sequence) -> None:
        """A prompt's last chunk is done and its first token sampled."""
        now = time.monotonic()
        self.phases.observe("prefill", now - seq.prefill_started)
        self.phases.observe("first_token", now - seq.started)

    def _arrived(self) -> list[Sequence]:
        """The requests submitted since the last step, in order, without the ones already cancelled (aborted, or
        their submit failed): model thread. It stops at one whose submit is still running (``accepting``): that
        submit may yet fail (a room used before), and a request the scheduler holds has no way back out; the kick
        that ends the submit queues the step that takes it."""
        taken = []
        while self.arrivals:
            seq = self.arrivals[0]
            if seq.accepting and not seq.cancelled:
                break
            self.arrivals.popleft()
            if not seq.cancelled:
                taken.append(seq)
        return taken

    def _arriving(self, key: int) -> bool:
        """Whether a request with this key is still among the arrivals (its submit is running): model thread."""
        # list() copies the deque in one C call, which appends from other threads cannot interleave with
        return any(seq.key == key and not seq.cancelled for seq in list(self.arrivals))
