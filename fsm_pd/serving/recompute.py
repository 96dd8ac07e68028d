"""Recompute on the decode node: a request whose KV transfer failed is prefilled here instead of failing.

The decode node has the weights, so when a transfer fails on it after it reserved the request's pages (a pull or
scatter that failed, a waiting or transfer deadline that passed), ``--on-transfer-failure recompute`` prefills the
prompt on this node, samples the first token exactly as the prefill node does (``forward.prefill_step``: the
request's seed, step 0) and hands the request to the decode loop. Sampling depends on the seed and the step only,
so the client gets the tokens an undisturbed run gives (greedy: identical). ``fail`` keeps the old behaviour: the
request ends with the transfer's error. A room failed by its peer (an ABORT: the prefill request was aborted or
failed; the prefill node dead or restarted) is not recomputed: the prefill leg of that request has failed too, so a
router answers it with that failure, or retries it elsewhere, and closes this leg.

Why recompute is the default: by the time a transfer fails the client has waited for a prefill already, and failing
costs a retry elsewhere (a new handshake, a new prefill, a new queue) where recomputing costs one prefill on a node
that is known to be up and holds the request. What it costs: the prefill runs between decode steps, so the other
requests on this node pause for it. It runs in chunks, one chunk step before each decode step, as a colocated node's
prompts do: at most ``max_tokens`` padded tokens a step, and while streams decode at most what the node's
``StepBudget`` allows (``scheduling/step_budget.py``: a few decode steps' time), so a prompt prefilled here delays the
running streams by a chunk at a time, not by its whole prefill.

The room itself still ends Failed, with its reason, in the journal. Once the recompute's prefill ran, the node
journals one more row for the room, role ``recompute`` (``Node.record``, replayed as a record by
``store/replay.py``): Success, or Failed with the prefill's error, and the request id, so ``fsm-pd replay --request``
shows that the request was answered after all. It is also a log line naming the room and the request, a counter
(``recomputes``; ``fsm_pd_transfer_recomputes_total``), the answer's ``meta_info.kv_recompute`` (``{"room",
"reason", "seconds"}``) and its route receipt (``meta_info.pd_route``, path ``pd``: the headers every answer
carries, ``api/streaming.py``). The failed room's ``FreePages`` returns the pages
it held under the room id; the recompute reserves pages of its own under the key ``-(room + 1)`` (rooms are never
negative), so that free cannot touch them. Model thread only, except ``counters``.

The same queue and prefill serve the requests a router sends a node whole (``start_local``, ``local_path.py``):
they never had a room, and are counted apart (``local_prefills``).
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections import deque
from collections.abc import Callable

import jax
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from fsm_pd.kvpool.pages import PageAllocator
from fsm_pd.model.input_buckets import batch_bucket, token_bucket
from fsm_pd.model.loader import LoadedModel
from fsm_pd.model.model_thread import ModelThread
from fsm_pd.scheduling.page_admission import CHUNKED_PREFILL_SIZE, plan_chunks, take_prefill_batch
from fsm_pd.scheduling.step_budget import StepBudget
from fsm_pd.serving.forward import prefill_step
from fsm_pd.serving.isolate import run_isolating
from fsm_pd.serving.sequence import Sequence
from fsm_pd.serving.types import EngineError
from fsm_pd.store.roles import RECOMPUTE_ROLE  # the journal role of a recompute's row (a record)

log = logging.getLogger(__name__)

ON_TRANSFER_FAILURE = ("recompute", "fail")
# the decode room's failures it recomputes: its own (a pull or scatter that failed, a deadline that passed) and its
# prefill node's death (heartbeats), whatever state the room was in: a READY lost with the dead process left it in
# WaitingForInput, and a 5xx then made the router retry the prompt on a fleet that may have no prefill node left.
# Not an abort: the prefill node is alive and failed the room itself (its leg fails too, the router retries it).
RECOMPUTED_TRIGGERS = frozenset({"error", "timeout", "peer_failed"})

# ``Node.record``: (role, room, trigger, dst, event, reason)
Record = Callable[[str, int, str, str, dict, "str | None"], None]


def recompute_key(room: int) -> int:
    """The allocator key of a recomputed request: negative, so never a room's."""
    return -(room + 1)


class TransferRecompute:
    def __init__(self, model: LoadedModel, model_thread: ModelThread, allocator: PageAllocator, page_size: int, *,
                 enabled: bool, headroom_pages: int, max_batch: int = 8, max_tokens: int = CHUNKED_PREFILL_SIZE,
                 budget: StepBudget | None = None, clock: Callable[[], float] = time.perf_counter):
        """``budget``: the node's step budget (its engine times the decode steps); None bounds a chunk step by
        ``max_tokens`` alone. ``clock`` times the chunk steps for it."""
        self.model, self.model_thread, self.allocator, self.page_size = model, model_thread, allocator, page_size
        self.enabled, self.headroom_pages = enabled, headroom_pages
        self.max_batch, self.max_tokens = max_batch, max_tokens
        self.budget, self._clock = budget, clock
        self.prefill_executor = prefill_step  # the model executor port: runs one step's chunks (forward.py)
        self.waiting: deque[Sequence] = deque()
        self.chunking: list[Sequence] = []  # pages reserved, prompt partly prefilled: the next chunks go first
        self.started = 0  # transfers failed and taken over here
        self.completed = 0  # of those, prefilled here (the request then decodes as any other)
        self.failed = 0  # the local prefill itself failed: the request got a 500
        self.recomputed_tokens = 0
        # requests the router sent here to prefill (``start_local``): the same queue and prefill, no failed room
        self.local = {"local_prefills": 0, "local_prefills_done": 0, "local_prefills_failed": 0,
                      "local_prefill_tokens": 0}
        self.on_local: Callable[[Sequence, Exception | None], None] | None = None  # the engine journals each
        self.record: Record | None = None  # the decode node's ``Node.record``: each recompute journaled as one row

    def counters(self) -> dict:
        return {"recomputes": self.started, "recomputes_prefilled": self.completed,
                "recomputes_failed": self.failed, "recompute_prompt_tokens": self.recomputed_tokens, **self.local}

    def owns(self, seq: Sequence) -> bool:
        return seq.key < 0

    def start(self, seq: Sequence, room: int, reason: str) -> None:
        """Take over ``seq``, whose room failed with ``reason`` after its pages were reserved."""
        seq.key = recompute_key(room)
        seq.pages = []
        seq.meta["kv_recompute"] = {"room": room, "reason": reason}
        # the route receipt a successful handoff would have written (decode_engine): the router sent it through a
        # prefill node, and nothing of that node's KV was used
        seq.meta["pd_route"] = {"path": "pd", "reason": (seq.request.route or {}).get("reason", ""),
                                "prefill": None, "pages": 0, "bytes": 0}
        seq.meta["recompute_queued_at"] = time.monotonic()
        self.waiting.append(seq)
        self.started += 1
        log.warning("room %d (request %s): the KV transfer failed (%s); recomputing its prompt of %d tokens on this "
                    "node (--on-transfer-failure recompute)", room, seq.rid, reason, seq.prompt_len)

    def start_local(self, seq: Sequence) -> None:
        """Take ``seq``, which the router sent here to prefill itself (``fsm_pd_route`` local; its key is already
        ``recompute_key`` of its room, so ``owns`` it): it waits in the same queue as the recomputes."""
        seq.pages = []
        seq.meta["recompute_queued_at"] = time.monotonic()
        self.waiting.append(seq)
        self.local["local_prefills"] += 1

    def ready_to_run(self) -> bool:
        """A prompt part-prefilled, or waiting work that fits as soon as a step runs (nothing holds pages, so the
        headroom is waived)."""
        return bool(self.chunking) or bool(self.waiting) and self.allocator.reserved_pages == 0

    def prefill(self, room_for: int, add: Callable[[Sequence], None], finish: Callable[[Sequence], None], *,
                decoding: bool = False) -> None:
        """One chunk step: the next chunks of the prompts under way, then the waiting requests whose pages fit
        (``room_for`` running slots left, those under way included). A prompt whose last chunk ran emits its first
        token and goes to ``add`` (the decode loop), or to ``finish`` when that token was its last (or it was
        cancelled meanwhile). ``decoding``: streams are decoding on this node, and the step budget may cut the
        step."""
        for seq in [s for s in self.chunking if s.cancelled]:
            self.chunking.remove(seq)
            finish(seq)
        budget = self.budget.tokens(decoding) if self.budget is not None else self.max_tokens
        chunks = plan_chunks(self.chunking, max_batch=self.max_batch, budget=budget)
        room_for -= len(self.chunking)
        if self.waiting and room_for > 0:
            admitted = take_prefill_batch(self.waiting, self.allocator, self.page_size,
                                          max_batch=min(room_for, self.max_batch - len(chunks)), max_tokens=budget,
                                          headroom=self.headroom_pages, drop=lambda s: s.cancelled, planned=chunks)
            self.chunking += admitted
            chunks = plan_chunks(admitted, max_batch=self.max_batch, budget=budget, planned=chunks)
        if not chunks:
            return
        if self.budget is not None and budget < self.max_tokens:
            self.budget.cut_steps += 1
        started = self._clock()
        firsts = run_isolating(chunks, lambda part: self.prefill_executor(self.model, self.model_thread, part),
                               "recompute prefill")
        if self.budget is not None:  # a step of chunks that all go on samples nothing: wait for its pass here
            with contextlib.suppress(RuntimeError):  # a pool a failed step left deleted: the next step reports it
                jax.block_until_ready(self.model_thread.pool)
            self.budget.observe_prefill(batch_bucket(len(chunks)) * token_bucket(max(c.length for c in chunks)),
                                        self._clock() - started)
        done = [(c.seq, first) for c, first in zip(chunks, firsts, strict=True) if first is not None]
        for seq, _ in done:
            self.chunking.remove(seq)
        for seq, first in done:
            if "kv_recompute" not in seq.meta:
                self._local_prefilled(seq, first, add, finish)
                continue
            info = seq.meta["kv_recompute"]
            info["seconds"] = round(time.monotonic() - seq.meta.pop("recompute_queued_at"), 6)
            self._journal(seq, info, first if isinstance(first, Exception) else None)
            if isinstance(first, Exception):
                self.failed += 1
                seq.stream.push(EngineError(f"the KV transfer failed ({info['reason']}) and recomputing the "
                                            f"prompt here failed too: {first}", 500))
                finish(seq)
                continue
            self.completed += 1
            self.recomputed_tokens += seq.prompt_len
            log.info("room %d (request %s): prompt recomputed in %.3f s", info["room"], seq.rid, info["seconds"])
            if seq.emit(first.token_id, first.logprob, first.input_logprobs, first.top_logprobs,
                        first.input_top_logprobs):
                finish(seq)
            else:
                add(seq)

    def _journal(self, seq: Sequence, info: dict, failed: Exception | None) -> None:
        """One ``recompute`` row for the failed room once its prompt was prefilled here (or that failed): what
        ``replay --request`` shows as the request's end."""
        if self.record is None:
            return
        event = {"rid": seq.rid, "transfer_failed": info["reason"], "prompt_len": seq.prompt_len,
                 "seconds": info["seconds"]}
        self.record(RECOMPUTE_ROLE, info["room"], "recompute", "Failed" if failed else "Success", event,
                    f"recompute failed: {failed}" if failed else None)

    def _local_prefilled(self, seq: Sequence, first, add, finish) -> None:
        seconds = round(time.monotonic() - seq.meta.pop("recompute_queued_at"), 6)
        seq.meta.setdefault("pd_route", {})["local_prefill_seconds"] = seconds
        failed = first if isinstance(first, Exception) else None
        if self.on_local is not None:
            self.on_local(seq, failed)
        if failed is not None:
            self.local["local_prefills_failed"] += 1
            seq.stream.push(EngineError(f"the local prefill of this request failed: {failed}", 500))
            finish(seq)
            return
        self.local["local_prefills_done"] += 1
        self.local["local_prefill_tokens"] += seq.prompt_len
        if seq.emit(first.token_id, first.logprob, first.input_logprobs, first.top_logprobs, first.input_top_logprobs):
            finish(seq)
        else:
            add(seq)

    def release(self, seq: Sequence) -> None:
        """A recomputed request ended: its pages go back (model thread)."""
        self.allocator.free(seq.key)
        self.allocator.forget(seq.key)

    def collector(self, labels: dict[str, str]) -> RecomputeCollector:
        return RecomputeCollector(self, labels)


class RecomputeCollector:
    """``/metrics``: transfers recomputed on this node, read at scrape time."""

    def __init__(self, recompute: TransferRecompute, labels: dict[str, str]):
        self._recompute, self._labels = recompute, dict(labels)

    def describe(self):
        return []

    def collect(self):
        values = self._recompute.counters()
        names, label_values = list(self._labels), list(self._labels.values())
        for name, key, doc in (
            ("fsm_pd_transfer_recomputes", "recomputes",
             "Requests whose KV transfer failed and whose prompt this decode node recomputed instead"),
            ("fsm_pd_transfer_recompute_failures", "recomputes_failed",
             "Recomputes whose own prefill failed (the request got a 500)"),
            ("fsm_pd_transfer_recompute_prompt_tokens", "recompute_prompt_tokens",
             "Prompt tokens prefilled on the decode node after failed transfers"),
            ("fsm_pd_local_prefills", "local_prefills",
             "Requests the router sent to this node whole, to prefill and decode itself (fsm_pd_route local)"),
            ("fsm_pd_local_prefill_failures", "local_prefills_failed", "Local prefills that failed (a 500)"),
            ("fsm_pd_local_prefill_prompt_tokens", "local_prefill_tokens",
             "Prompt tokens this node prefilled for requests routed to it whole"),
        ):
            family = CounterMetricFamily(name, doc, labels=names)
            family.add_metric(label_values, float(values[key]))
            yield family
        waiting = GaugeMetricFamily("fsm_pd_transfer_recomputes_waiting", "Recomputes waiting for pages",
                                    labels=names)
        waiting.add_metric(label_values, float(len(self._recompute.waiting)))
        yield waiting
