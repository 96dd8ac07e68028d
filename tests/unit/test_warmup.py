"""Server warm-up: the shapes it compiles are the shapes the schedulers form, and a warmed node compiles nothing while
it serves, whatever mix of requests comes."""

from __future__ import annotations

import asyncio
import threading
import time
from collections import deque

import jax
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jax._src import monitoring

from fsm_pd.kvpool.pages import PageAllocator
from fsm_pd.model import compiles, input_buckets
from fsm_pd.model.forward_shapes import prefill_shapes
from fsm_pd.model.grammar import GrammarSpec
from fsm_pd.model.loader import load_model
from fsm_pd.model.sampling import SamplingParams
from fsm_pd.scheduling.page_admission import plan_chunks, take_prefill_batch
from fsm_pd.serving import warmup
from fsm_pd.serving.collect import generate
from fsm_pd.serving.colocated_engine import ColocatedEngine
from fsm_pd.serving.sequence import Sequence
from fsm_pd.serving.types import GenerateRequest, RequestStream
from fsm_pd.serving.warmup import compile_rest, warm_up
from fsm_pd.serving.warmup_plan import SHORT_PROMPT_TOKENS, plan_for

# two computations of the model compared (logits, greedy tokens): float32 products at full precision on a TPU
# too (tests/on_chip.py)
pytestmark = [pytest.mark.chip, pytest.mark.usefixtures("full_precision")]  # chip: tests/on_tpu.sh

MAX_BATCH, MAX_TOKENS, PAGE_SIZE, PAGES = 8, 512, 16, 64


def queued(lengths: list[int], tokenizer) -> deque[Sequence]:
    loop = asyncio.new_event_loop()  # streams need one; nothing is pushed to them here
    return deque(Sequence.start(GenerateRequest(f"r{i}", [1] * n, SamplingParams(), seed=0),
                                RequestStream(f"r{i}", loop),
                                key=i, pages=[], tokenizer=tokenizer, eos_token_ids=(), max_context=PAGES * PAGE_SIZE)
                 for i, n in enumerate(lengths))


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(1, (PAGES - 1) * PAGE_SIZE - 1), min_size=1, max_size=20))
def test_prefill_steps_take_only_shapes_the_warmup_compiles(lengths):
    """The chunked-prefill scheduler's steps (the chunks under way, then new prompts beside them) form only the
    shapes the warm-up compiled, whatever the prompt lengths; every prompt is prefilled whole, once."""
    tokenizer = load_model("tiny").tokenizer
    planned = set(prefill_shapes(MAX_BATCH, MAX_TOKENS))
    queue, allocator, under_way, done = queued(lengths, tokenizer), PageAllocator(4096), [], []
    while queue or under_way:
        chunks = plan_chunks(under_way, max_batch=MAX_BATCH, budget=MAX_TOKENS)
        admitted = take_prefill_batch(queue, allocator, PAGE_SIZE, max_batch=MAX_BATCH - len(chunks),
                                      max_tokens=MAX_TOKENS, headroom=0, drop=lambda s: False, planned=chunks)
        under_way += admitted
        chunks = plan_chunks(admitted, max_batch=MAX_BATCH, budget=MAX_TOKENS, planned=chunks)
        assert chunks
        shape = (input_buckets.batch_bucket(len(chunks)), input_buckets.token_bucket(max(c.length for c in chunks)))
        assert shape in planned, f"chunks {[c.length for c in chunks]} form {shape}, which is not compiled"
        for chunk in chunks:
            assert chunk.start == chunk.seq.prefilled
            chunk.seq.prefilled += chunk.length
            if chunk.last:
                under_way.remove(chunk.seq)
                done.append(chunk.seq)
                allocator.free(chunk.seq.key)
    assert sorted(s.prompt_len for s in done) == sorted(lengths)


def _requests(greedy_only: bool = False) -> list[GenerateRequest]:
    schema = '{"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}'
    kinds = [  # every sampler path, penalties and a grammar, logprobs with and without alternatives
        dict(temperature=0.0), dict(temperature=0.8, top_p=0.9), dict(temperature=1.0, top_k=5, min_p=0.1),
        dict(temperature=0.0, frequency_penalty=0.5, logit_bias=((65, 3.0),)),
        dict(temperature=0.0, grammar=GrammarSpec("json_schema", schema)),
    ]
    lengths = [3, 17, 40, 90, 200, 600, 900]  # one prompt alone up to the context's bucket, and batches
    return [GenerateRequest(f"r{i}", [(7 * i + j) % 250 + 1 for j in range(n)],
                            SamplingParams(max_new_tokens=1 + i % 7, ignore_eos=True,
                                           **(kinds[0] if greedy_only else kinds[i % 5])),
                            seed=i, return_logprob=i % 3 == 0, top_logprobs_num=2 if i % 6 == 0 else 0)
            for i, n in enumerate(lengths * 3)]


def _serve(engine, requests, *, one_by_one: bool = False) -> list:
    async def serve_all():
        if one_by_one:
            return [await generate(engine, r) for r in requests]
        return await asyncio.gather(*(generate(engine, r) for r in requests))

    outs = asyncio.run(asyncio.wait_for(serve_all(), 240))
    assert all(out[-1].finish_reason is not None for out in outs)
    return [[token.token_id for token in out] for out in outs]


def test_the_ready_set_compiles_side_by_side_on_the_warm_up_threads(monkeypatch):
    """Every program of the ready set is compiled ahead on the warm-up's threads, and as many at once as there are
    threads: XLA's compile lets go of the interpreter's lock (a cold SmolLM2 node's programs took 27 s one after
    the other on the chip)."""
    monkeypatch.setattr(warmup, "COMPILE_THREADS", 2)
    spans: list[tuple[float, float, str]] = []

    def on_duration(event: str, seconds: float, **_) -> None:
        if event == "/jax/core/compile/backend_compile_duration":
            now = time.monotonic()
            spans.append((now - seconds, now, threading.current_thread().name))

    engine = ColocatedEngine("tiny", num_pages=43, page_size=PAGE_SIZE, chunked_prefill_size=MAX_TOKENS)
    jax.monitoring.register_event_duration_secs_listener(on_duration)
    # every program compiled here, none read back from a persistent cache (the chip's run has one: tests/on_tpu.sh)
    cached = jax.config.jax_enable_compilation_cache
    jax.config.update("jax_enable_compilation_cache", False)
    try:
        report = warm_up(engine, progress=False)
    finally:
        jax.config.update("jax_enable_compilation_cache", cached)
        monitoring.unregister_event_duration_listener(on_duration)
        engine.close()
    # at least the pool's programs: the samplers, which no pool shape changes, may already sit in this process's
    # memory from an earlier test (the chip half runs in one process: 5 compiled there, 10 or more on a fresh worker)
    assert report["programs"] == len(spans) >= 4
    assert {name.rsplit("_", 1)[0] for *_, name in spans} == {"warm-up-compile"}, spans
    assert any(a[0] < b[1] and b[0] < a[1] for i, a in enumerate(spans) for b in spans[i + 1:]), \
        "no two programs compiled at once"


@pytest.mark.slow
def test_a_node_ready_on_its_ready_set_serves_every_shape_without_compiling():
    """Warm-up prepares only the ready set (the single-row and the largest decode, the longest and a short
    single-row prefill, the samplers, the logprob programs); every batch and prompt length the schedulers then form
    runs on them, padded up or row by row, and compiles nothing. Once the background compile has run, every shape is
    there, and greedy answers are the same on their own shapes. (Served one by one: a row's logits move in the last
    bits with the batch it runs in, which flips the random tiny model's near-ties; a padded row computes exactly what
    it does on its own shape.)
    """
    pages = 80  # a pool size no other test uses: its programs (shared per process and pool shape) start empty
    # Batches of up to 2 prompts and 4 streams, chunks of 128 tokens: 10 forward shapes and 3 sampler buckets to
    # prepare (the defaults, 8 and 64 and 512, make 25 and 7: 50 compiles, the chip half's longest test), and still
    # every kind of cover: prompts padded to a longer one, a batch row by row, a decode batch on the single row.
    chunk = 128
    engine = ColocatedEngine("tiny", num_pages=pages, page_size=PAGE_SIZE, chunked_prefill_size=chunk, max_running=4,
                             max_prefill_batch=2)
    try:
        plan = plan_for(engine)
        assert len(plan.forward) == 10 and plan.sample_batches == [1, 2, 4]
        report = warm_up(engine, progress=False)
        programs = engine.model.programs(engine.model_thread.pool)
        # the single-row decode, the largest decode batch, the longest single-row prefill, and a short prompt's (a
        # colocated node prefills)
        assert report["forward_shapes"] == len(plan.ready_forward) == 4
        assert programs.shapes == set(plan.ready_forward) == {(1, 1), (4, 1), (1, SHORT_PROMPT_TOKENS), (1, chunk)}
        before = sum(compiles.counts().values())
        _serve(engine, _requests())
        greedy = _serve(engine, _requests(greedy_only=True)[:7], one_by_one=True)
        assert sum(compiles.counts().values()) == before, f"compiled while serving: {list(compiles.late)}"

        compile_rest(engine).join(timeout=240)
        assert programs.shapes == set(plan.forward)
        assert compiles.counts()["background"] >= len(plan.background_forward)
        before = sum(compiles.counts().values())
        assert _serve(engine, _requests(greedy_only=True)[:7], one_by_one=True) == greedy
        assert sum(compiles.counts().values()) == before
    finally:
        engine.close()


@pytest.mark.slow
def test_several_steps_a_dispatch_compile_in_the_background_and_serve_without_compiling():
    """A node that runs several decode steps a dispatch: ready on its ready set, it decodes a step at a time
    (covered, compiling nothing) until the background has compiled a multi-step program for every batch bucket and
    page-table width; then its batches run several steps a dispatch, compile nothing, and answer the same."""
    # few shapes of each kind (two batch buckets, three table widths, short prompts): the background compiles them all
    engine = ColocatedEngine("tiny", num_pages=20, page_size=PAGE_SIZE, max_running=2, max_prefill_batch=2,
                             chunked_prefill_size=64, decode_steps_per_dispatch=4)
    requests = [GenerateRequest(f"s{i}", [(5 * i + j) % 250 + 1 for j in range(3 + 15 * i)],
                                SamplingParams(temperature=0.0, max_new_tokens=9, ignore_eos=True), seed=i)
                for i in range(4)]
    try:
        plan = plan_for(engine)
        loops = engine.model.programs(engine.model_thread.pool).steps
        assert loops.widths == [4, 16, 20]  # 19 usable pages of 16 tokens, in whole blocks of 4 pages
        assert plan.steps_per_dispatch == 4 and plan.step_loops == [(b, w) for b in (1, 2) for w in loops.widths]
        warm_up(engine, progress=False)
        before = sum(compiles.counts().values())
        stepwise = _serve(engine, requests)
        assert engine.loop.dispatches == 0 and sum(compiles.counts().values()) == before
        compile_rest(engine).join(timeout=240)
        assert loops.shapes == {(b, w, 4) for b, w in plan.step_loops}
        before = sum(compiles.counts().values())
        assert _serve(engine, requests) == stepwise
        assert engine.loop.dispatches > 0 and sum(compiles.counts().values()) == before
    finally:
        engine.close()
