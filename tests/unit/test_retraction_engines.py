"""Retraction under KV pressure: the policy (which running sequences give their pages back), and the colocated and
PD engines on pools far too small for their load: every request completes with the tokens an unpressured run
gives, the counters say what happened, and the pools are whole again at the end."""

from __future__ import annotations

import asyncio
import re

import pytest
from node_sockets import node_sockets
from prometheus_client import generate_latest
from test_batch_isolation import gate
from test_serving_colocated import PAGE_SIZE, PAGES, ids_of, request, run, until
from test_serving_pd import assert_idle, pd_request, through_pd

from fsm_pd.machines import KVPoll
from fsm_pd.model.loader import load_model
from fsm_pd.serving.collect import generate
from fsm_pd.serving.colocated_engine import ColocatedEngine
from fsm_pd.serving.decode_engine import DecodeEngine
from fsm_pd.serving.prefill_engine import PrefillEngine
from fsm_pd.serving.retraction import pick_retractions
from fsm_pd.serving.types import EngineError, RequestStream

# two computations of the model compared (logits, greedy tokens): float32 products at full precision on a TPU
# too (tests/on_chip.py)
pytestmark = pytest.mark.usefixtures("full_precision")

NEW_TOKENS = 40
PROMPTS = [[(7 * i + j) % 200 + 1 for j in range(5 + i % 4)] for i in range(8)]  # 5 to 8 tokens: 2 pages each
SMALL = 41  # 40 usable pages of 4 tokens; each request grows to 12 pages, so about 3 of the 8 fit at once


# --- the policy ---

def test_nothing_is_retracted_while_the_pool_covers_every_sequence():
    assert pick_retractions([("a", 3, 1), ("b", 2, 1)], free_pages=2) == []
    assert pick_retractions([], free_pages=0) == []


def test_the_newest_go_first_and_only_as_many_as_needed():
    demands = [("old", 5, 1), ("mid", 4, 1), ("new", 1, 1), ("newest", 2, 1)]  # oldest first
    assert pick_retractions(demands, free_pages=3) == ["newest"]  # 4 lacking, 3 free: newest gives 2, lacks 1 less
    assert pick_retractions(demands, free_pages=0) == ["newest", "new"]  # 0+2+1 free vs 4-1-1 lacking
    assert pick_retractions(demands, free_pages=1) == ["newest"]  # 1+2 = 3 free vs 3 lacking


def test_the_oldest_is_never_retracted():
    assert pick_retractions([("old", 9, 1), ("new", 0, 1)], free_pages=0) == ["new"]
    assert pick_retractions([("only", 9, 1)], free_pages=0) == []


def test_a_sequence_that_needs_nothing_still_gives_its_pages():
    # 'new' lacks nothing this step, but its pages are what the oldest needs
    assert pick_retractions([("old", 4, 2), ("new", 3, 0)], free_pages=0) == ["new"]


# --- the engines ---

@pytest.fixture(scope="module")
def model():
    return load_model("tiny")


@pytest.fixture(scope="module")
def unpressured(model):
    """What every prompt yields with room to spare, one at a time."""
    engine = ColocatedEngine(model, num_pages=PAGES, page_size=PAGE_SIZE)
    try:
        return [ids_of(run(generate(engine, greedy(f"u{i}", p)))) for i, p in enumerate(PROMPTS)]
    finally:
        engine.close()


def greedy(rid, ids):
    return request(rid, ids, max_new_tokens=NEW_TOKENS, ignore_eos=True)


async def all_at_once(engine, requests):
    return await asyncio.gather(*(generate(engine, r) for r in requests))


def test_colocated_retracts_and_resumes_with_identical_greedy_output(model, unpressured):
    engine = ColocatedEngine(model, num_pages=SMALL, page_size=PAGE_SIZE)
    try:
        outs = run(all_at_once(engine, [greedy(f"c{i}", p) for i, p in enumerate(PROMPTS)]))
        assert [ids_of(o) for o in outs] == unpressured
        assert all(o[-1].finish_reason == {"type": "length"} for o in outs)
        info = engine.info()
        assert info["preempted"] > 0, "the pool is too small for the batch: something must have been retracted"
        assert info["resumed"] == info["preempted"] and info["retracted_waiting"] == 0
        assert info["recomputed_tokens"] > 0
        assert until(lambda: engine.info()["pages_reserved"] == 0 and engine.info()["requests_live"] == 0)
        metrics = generate_latest(engine.registries[0]).decode()
        assert re.search(rf"fsm_pd_preemptions_total{{[^}}]*}} {info['preempted']}\.0", metrics), metrics
        assert re.search(rf"fsm_pd_resumptions_total{{[^}}]*}} {info['resumed']}\.0", metrics), metrics
    finally:
        engine.close()


def test_a_retracted_request_can_be_aborted_while_it_waits(model):
    engine = ColocatedEngine(model, num_pages=SMALL, page_size=PAGE_SIZE)
    try:
        async def scenario():
            requests = [greedy(f"a{i}", p) for i, p in enumerate(PROMPTS)]
            tasks = [asyncio.ensure_future(generate(engine, r)) for r in requests]
            while not engine.loop.retracted:
                await asyncio.sleep(0.005)
            victim = engine.loop.retracted[-1].rid
            assert engine.abort(victim)
            results = await asyncio.gather(*tasks, return_exceptions=True)
            return victim, dict(zip([r.rid for r in requests], results, strict=True))

        victim, results = run(scenario())
        assert isinstance(results[victim], EngineError) and results[victim].status == 499
        assert all(len(r) == NEW_TOKENS for rid, r in results.items() if rid != victim)
        assert until(lambda: engine.info()["pages_reserved"] == 0 and engine.info()["requests_live"] == 0)
    finally:
        engine.close()


def test_retracted_requests_resume_before_later_arrivals_are_admitted(model, monkeypatch):
    import fsm_pd.serving.colocated_engine as colocated

    engine = ColocatedEngine(model, num_pages=SMALL, page_size=PAGE_SIZE)
    admitted_while_retracted = []

    def watched(queue, *args, **kwargs):
        batch = take_prefill_batch(queue, *args, **kwargs)
        if batch and engine.loop.retracted:
            admitted_while_retracted.append([s.rid for s in batch])
        return batch

    take_prefill_batch = colocated.take_prefill_batch
    monkeypatch.setattr(colocated, "take_prefill_batch", watched)
    try:
        async def scenario():
            first = [asyncio.ensure_future(generate(engine, greedy(f"f{i}", p))) for i, p in enumerate(PROMPTS)]
            while not engine.loop.retracted:
                await asyncio.sleep(0.002)
            later = [asyncio.ensure_future(generate(engine, greedy(f"l{i}", p))) for i, p in enumerate(PROMPTS)]
            return await asyncio.gather(*first, *later)

        outs = run(scenario())
        assert all(len(o) == NEW_TOKENS for o in outs)
        assert engine.info()["preempted"] > 0
        assert admitted_while_retracted == []
    finally:
        engine.close()


def test_a_request_that_could_never_fit_the_pool_gets_400_at_submit(model):
    engine = ColocatedEngine(model, num_pages=SMALL, page_size=PAGE_SIZE)
    try:
        too_much = request("big", [1, 2, 3], max_new_tokens=(SMALL - 1) * PAGE_SIZE)  # 3 tokens over the pool
        with pytest.raises(EngineError) as err:
            engine.submit(too_much, RequestStream("big", asyncio.new_event_loop()))
        assert err.value.status == 400 and "KV pool" in str(err.value) and "max_new_tokens" in str(err.value)
        fits = request("fits", [1, 2, 3], max_new_tokens=(SMALL - 1) * PAGE_SIZE - 3, ignore_eos=True)
        assert len(run(generate(engine, fits))) == (SMALL - 1) * PAGE_SIZE - 3  # alone it takes the whole pool
    finally:
        engine.close()


def test_flush_cache_is_refused_while_a_request_is_live_and_done_when_idle(model):
    engine = ColocatedEngine(model, num_pages=SMALL, page_size=PAGE_SIZE)
    try:
        async def scenario():
            task = asyncio.ensure_future(generate(engine, greedy("live", PROMPTS[0])))
            while engine.info()["requests_running"] == 0:
                await asyncio.sleep(0.005)
            busy = await asyncio.to_thread(engine.flush_cache)
            await task
            return busy

        ok, message = run(scenario())
        assert not ok and "not flushed" in message
        assert until(lambda: engine.info()["requests_live"] == 0)
        ok, message = engine.flush_cache()
        assert ok and "flushed" in message
        assert list(engine.allocator._free) == list(range(1, SMALL))
    finally:
        engine.close()


@pytest.fixture
def small_pd(model, tmp_path):
    """A prefill pool for 2 prompts at a time and a decode pool for about 3 growing sequences."""
    p = PrefillEngine(model, num_pages=5, page_size=PAGE_SIZE, backend="fake", journal=str(tmp_path / "p.db"),
                      **node_sockets(tmp_path, "p", bootstrap=True))
    d = DecodeEngine(model, num_pages=SMALL, page_size=PAGE_SIZE, backend="fake", secret=p.secret,
                     journal=str(tmp_path / "d.db"), **node_sockets(tmp_path, "d"))
    yield p, d
    d.close()
    p.close()


def test_pd_under_pressure_completes_every_request_with_unpressured_output(model, tmp_path, unpressured):
    # a prefill pool for all 8 prompts, held until every room waits for input: one prefill batch hands all 8 to the
    # decode node at once. (Prefilling 2 at a time, a slow prefill on a loaded machine let the decode node finish
    # each pair before the next came, and no pressure built up.)
    p = PrefillEngine(model, num_pages=17, page_size=PAGE_SIZE, backend="fake", journal=str(tmp_path / "p.db"),
                      **node_sockets(tmp_path, "p", bootstrap=True))
    d = DecodeEngine(model, num_pages=SMALL, page_size=PAGE_SIZE, backend="fake", secret=p.secret,
                     journal=str(tmp_path / "d.db"), **node_sockets(tmp_path, "d"))

    async def scenario():
        requests = [pd_request(p, f"pd{i}", pr, max_new_tokens=NEW_TOKENS, ignore_eos=True)
                    for i, pr in enumerate(PROMPTS)]
        release = gate(p)
        tasks = [asyncio.ensure_future(through_pd(p, d, r)) for r in requests]
        ready = await asyncio.to_thread(until, lambda: all(
            p.manager.poll(r.bootstrap.room) is KVPoll.WaitingForInput for r in requests), 60)
        release.set()
        assert ready
        return await asyncio.gather(*tasks)

    try:
        outs = run(scenario())
        assert [ids_of(o) for o in outs] == unpressured
        info = d.info()
        assert info["preempted"] > 0 and info["resumed"] == info["preempted"] and info["retracted_waiting"] == 0
        assert_idle(p, d)
        metrics = generate_latest(d.registry).decode()
        assert re.search(rf'fsm_pd_preemptions_total{{node="decode-0",role="decode"}} {info["preempted"]}\.0',
                         metrics)
    finally:
        d.close()
        p.close()


def test_decode_refuses_a_request_beyond_its_pool_with_400(small_pd):
    p, d = small_pd
    too_much = pd_request(p, "big", [1, 2, 3], max_new_tokens=(SMALL - 1) * PAGE_SIZE)
    with pytest.raises(EngineError) as err:
        d.submit(too_much, RequestStream("big", asyncio.new_event_loop()))
    assert err.value.status == 400 and "KV pool" in str(err.value)
    assert d.info()["requests_live"] == 0
