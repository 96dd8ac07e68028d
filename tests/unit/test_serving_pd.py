"""A prefill engine and a decode engine in one process (real side channel and bootstrap server on 127.0.0.1, or unix
sockets on a host without TCP: ``node_sockets.py``; the in-process ``fake`` data plane): token-for-token the colocated
engine's output, aborts on either side, 400s."""

from __future__ import annotations

import asyncio
import dataclasses
import threading

import pytest
from node_sockets import node_sockets
from test_serving_colocated import PAGE_SIZE, PAGES, ids_of, request, run, until

from fsm_pd.machines import KVPoll
from fsm_pd.model.loader import load_model
from fsm_pd.serving.collect import generate
from fsm_pd.serving.colocated_engine import ColocatedEngine
from fsm_pd.serving.decode_engine import DecodeEngine
from fsm_pd.serving.prefill_engine import PrefillEngine
from fsm_pd.serving.types import Bootstrap, EngineError, RequestStream

# two computations of the model compared (logits, greedy tokens): float32 products at full precision on a TPU
# too (tests/on_chip.py)
pytestmark = [pytest.mark.chip, pytest.mark.usefixtures("full_precision")]  # chip: tests/on_tpu.sh


@pytest.fixture(scope="module")
def model():
    return load_model("tiny")


@pytest.fixture(scope="module")
def pd(model, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("pd")
    p = PrefillEngine(model, num_pages=PAGES, page_size=PAGE_SIZE, backend="fake", journal=str(tmp / "p.db"),
                      **node_sockets(tmp, "p", bootstrap=True))
    d = DecodeEngine(model, num_pages=PAGES, page_size=PAGE_SIZE, backend="fake", secret=p.secret,
                     journal=str(tmp / "d.db"), **node_sockets(tmp, "d"))
    yield p, d
    d.close()
    p.close()


_rooms = iter(range(1000, 10**6))


def pd_request(p, rid, ids, **sampling):
    host, port = p.bootstrap_host_port
    return dataclasses.replace(request(rid, ids, **sampling), bootstrap=Bootstrap(host, port, next(_rooms)))


async def through_pd(p, d, req):
    """What the router does: send the request to both nodes; the answer is the decode node's."""
    prefill, decode = await asyncio.gather(generate(p, req), generate(d, req))
    assert len(prefill) == 1 and prefill[0].finish_reason == {"type": "length"}
    assert prefill[0].token_id == decode[0].token_id
    return decode


def idle(engine) -> bool:
    info = engine.info()
    return info["pages_reserved"] == 0 and info["requests_live"] == 0 and not info["rooms_by_state"]


def assert_idle(*engines) -> None:
    if not until(lambda: all(idle(e) for e in engines)):
        pytest.fail("not idle: " + "; ".join(repr(e.info()) for e in engines))


def varied_prompts(tokenizer) -> list[list[int]]:
    # lengths around the page size (4): shorter than a page, exactly one, one past it, and many pages
    lengths = [1, 2, 3, 4, 5, 7, 8, 9, 12, 13, 16, 17, 23, 31, 32, 33, 47, 64, 90, 120]
    text = "the quick brown fox jumps over the lazy dog; " * 4
    return [tokenizer.encode(text[i % 7 : i % 7 + n]) for i, n in enumerate(lengths)]


def test_pd_matches_colocated_for_varied_prompts_at_concurrency_8(pd, model):
    p, d = pd
    prompts = varied_prompts(model.tokenizer)
    colocated = ColocatedEngine(model, num_pages=PAGES, page_size=PAGE_SIZE)
    try:
        want = [ids_of(run(generate(colocated, request(f"c{i}", x, max_new_tokens=12)))) for i, x in enumerate(prompts)]
    finally:
        colocated.close()

    async def all_through_pd():
        gate = asyncio.Semaphore(8)

        async def one(i, x):
            async with gate:
                return await through_pd(p, d, pd_request(p, f"r{i}", x, max_new_tokens=12))

        return await asyncio.gather(*[one(i, x) for i, x in enumerate(prompts)])

    got = [ids_of(outs) for outs in run(all_through_pd())]
    assert got == want
    assert_idle(p, d)


def test_pd_carries_first_token_logprobs(pd, model):
    p, d = pd
    prompt = model.tokenizer.encode("logprobs over the wire")
    req = dataclasses.replace(pd_request(p, "lp", prompt, max_new_tokens=3), return_logprob=True)
    outs = run(through_pd(p, d, req))
    first = outs[0]
    assert first.logprob is not None and first.logprob <= 0
    assert len(first.input_token_logprobs) == len(prompt) and first.input_token_logprobs[0] is None
    assert all(o.logprob is not None for o in outs) and "queue_and_transfer_seconds" in outs[-1].meta


def test_decode_abort_mid_stream_frees_pages_on_both_nodes(pd, model):
    p, d = pd
    assert_idle(p, d)
    req = pd_request(p, "ab", model.tokenizer.encode("abort me while decoding"), max_new_tokens=200, ignore_eos=True)

    async def abort_after_three():
        prefill = asyncio.ensure_future(generate(p, req))
        stream = RequestStream("ab")
        d.submit(req, stream)
        got = 0
        with pytest.raises(EngineError) as err:
            async for _ in stream:
                got += 1
                if got == 3:
                    assert d.abort("ab")
        await prefill
        return got, err.value

    got, err = run(abort_after_three())
    assert err.status == 499 and got >= 3
    assert_idle(p, d)


def hold_model_thread(engine) -> threading.Event:
    """Park a job on the engine's model thread: no prefill (or scatter) runs until the event is set."""
    release = threading.Event()
    engine.model_thread.submit(lambda owner: release.wait(30))
    return release


def test_prefill_abort_surfaces_as_engine_error_on_decode(pd, model):
    p, d = pd
    req = pd_request(p, "pa", model.tokenizer.encode("the prefill node gives up"), max_new_tokens=8)
    room = req.bootstrap.room
    release = hold_model_thread(p)  # P hears PREPARE but cannot prefill: the room waits in WaitingForInput

    async def scenario():
        prefill = asyncio.ensure_future(generate(p, req))
        decode = asyncio.ensure_future(generate(d, req))
        while p.manager.poll(room) != KVPoll.WaitingForInput:
            await asyncio.sleep(0.01)
        assert p.abort("pa")
        results = await asyncio.gather(prefill, decode, return_exceptions=True)
        release.set()
        return results

    try:
        on_p, on_d = run(scenario())
    finally:
        release.set()
    assert isinstance(on_p, EngineError) and on_p.status == 499
    assert isinstance(on_d, EngineError) and on_d.status == 502 and "aborted by peer" in str(on_d)
    assert_idle(p, d)


def test_decode_abort_during_transfer_fails_the_prefill_request(pd, model):
    p, d = pd
    req = pd_request(p, "da", model.tokenizer.encode("the decode node gives up"), max_new_tokens=8)
    room = req.bootstrap.room
    release = hold_model_thread(p)

    async def scenario():
        prefill = asyncio.ensure_future(generate(p, req))
        decode = asyncio.ensure_future(generate(d, req))
        while d.manager.poll(room) != KVPoll.WaitingForInput:
            await asyncio.sleep(0.01)
        assert d.abort("da")
        while p.manager.poll(room) != KVPoll.Failed:  # the ABORT reached P while its model thread was held
            await asyncio.sleep(0.01)
        release.set()  # P's scheduler now hears of the failed room and answers its request
        return await asyncio.gather(prefill, decode, return_exceptions=True)

    try:
        on_p, on_d = run(scenario())
    finally:
        release.set()
    assert isinstance(on_d, EngineError) and on_d.status == 499
    assert isinstance(on_p, EngineError) and on_p.status == 502 and "aborted by peer" in str(on_p)
    assert_idle(p, d)


def test_an_abort_before_its_request_refuses_it_and_the_retry_with_the_same_rid_runs(pd, model):
    # The router's abort of a failed attempt reached the decode node before the attempt's own request did (its
    # prefill had refused at once). That request must not register and wait for a room its prefill never opens:
    # it held the rid when the retry came, and the retry got 400 "already running".
    p, d = pd
    prompt = model.tokenizer.encode("an abort that came first")
    late = pd_request(p, "late", prompt, max_new_tokens=6)
    assert not d.abort("late", room=late.bootstrap.room)  # nothing live yet: the room is remembered
    with pytest.raises(EngineError) as err:
        d.submit(late, RequestStream("late", asyncio.new_event_loop()))
    assert err.value.status == 499 and "aborted before it arrived" in str(err.value)
    retry = pd_request(p, "late", prompt, max_new_tokens=6)  # the same rid, a new room
    assert len(run(through_pd(p, d, retry))) == 6
    assert_idle(p, d)


async def opened(engine, room: int, *legs: asyncio.Future) -> None:
    """Until ``engine`` has the room; a leg that failed meanwhile (its submit refused) raises here at once."""
    while engine.manager.poll(room) is None:
        for leg in legs:
            if leg.done():
                leg.result()
        await asyncio.sleep(0.01)


def test_a_retry_runs_beside_its_attempt_and_an_abort_by_room_stops_only_its_own(pd, model):
    p, d = pd
    prompt = model.tokenizer.encode("two attempts of one request")
    first, retry = (pd_request(p, "twice", prompt, max_new_tokens=6) for _ in range(2))
    release = hold_model_thread(p)  # the first attempt cannot finish before the retry is in

    async def scenario():
        old = [asyncio.ensure_future(generate(e, first)) for e in (p, d)]
        await opened(d, first.bootstrap.room, *old)
        new = asyncio.ensure_future(through_pd(p, d, retry))  # the same rid while the first is live on both
        await opened(d, retry.bootstrap.room, new)
        assert p.abort("twice", room=first.bootstrap.room) and d.abort("twice", room=first.bootstrap.room)
        release.set()
        return await asyncio.gather(*old, return_exceptions=True), await new

    try:
        old, new = run(scenario())
    finally:
        release.set()
    assert [isinstance(o, EngineError) and o.status == 499 for o in old] == [True, True], old
    assert len(new) == 6
    assert_idle(p, d)


def test_an_abort_by_rid_alone_stops_every_attempt_of_it(pd, model):
    p, d = pd
    prompt = model.tokenizer.encode("every attempt of a rid")
    release = hold_model_thread(p)

    async def scenario():
        reqs = [pd_request(p, "all", prompt, max_new_tokens=6) for _ in range(2)]
        legs = [asyncio.ensure_future(generate(e, r)) for r in reqs for e in (p, d)]
        for r in reqs:
            await opened(d, r.bootstrap.room, *legs)
        assert p.abort("all") and d.abort("all")  # SGLang's abort: every live request of the rid
        release.set()
        return await asyncio.gather(*legs, return_exceptions=True)

    try:
        ends = run(scenario())
    finally:
        release.set()
    assert [isinstance(e, EngineError) and e.status == 499 for e in ends] == [True] * 4, ends
    assert_idle(p, d)


def test_pd_nodes_refuse_requests_without_bootstrap_or_too_long(pd, model):
    p, d = pd
    for engine in (p, d):
        with pytest.raises(EngineError) as err:
            engine.submit(request("nb", [1, 2, 3]), RequestStream("nb", asyncio.new_event_loop()))
        assert err.value.status == 400 and "bootstrap" in str(err.value)
        too_long = pd_request(p, "tl", [1] * engine.max_context)
        with pytest.raises(EngineError) as err:
            engine.submit(too_long, RequestStream("tl", asyncio.new_event_loop()))
        assert err.value.status == 400
    assert idle(p) and idle(d)
