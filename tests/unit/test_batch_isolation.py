"""A request that fails inside a batched model call fails alone: its neighbours in the same prefill batch or decode
step get exactly the tokens they get when run by themselves (tiny model, real engines, the fake data plane).

The culprits are requests the API would refuse (a token id beyond int32) or values changed behind the checks' back
(a sampling value no compiled program takes): what a bug upstream, or a check not yet written, lets through.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
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
pytestmark = pytest.mark.usefixtures("full_precision")

BAD_TOKEN = 2**40  # does not fit the int32 token array of a batched prefill


@pytest.fixture(scope="module")
def model():
    return load_model("tiny")


def prompts(model) -> list[list[int]]:
    return [model.tokenizer.encode(f"neighbour {i}: " + "xyz" * i) for i in range(4)]


def gate(engine) -> threading.Event:
    """Hold the engine's model thread until the returned event is set, so the next step batches what queued up."""
    release = threading.Event()
    engine.model_thread.submit(lambda owner: release.wait(60))
    return release


async def outcome(engine, req):
    try:
        return ids_of(await generate(engine, req))
    except EngineError as err:
        return err


def isolation_logged(caplog, what: str, n: int) -> bool:
    return any(r.name == "fsm_pd.serving.isolate" and f"{what} of {n} requests failed" in r.getMessage()
               for r in caplog.records)


def test_colocated_prefill_batch_with_a_bad_request(model, caplog):
    caplog.set_level(logging.WARNING, logger="fsm_pd.serving.isolate")
    engine = ColocatedEngine(model, num_pages=PAGES, page_size=PAGE_SIZE, max_prefill_batch=8)
    try:
        good = [request(f"g{i}", p, max_new_tokens=6) for i, p in enumerate(prompts(model))]
        alone = [ids_of(run(generate(engine, r))) for r in good]
        bad = request("bad", [1, 2, BAD_TOKEN], max_new_tokens=6)
        batch = [dataclasses.replace(r, rid=r.rid + "-b") for r in good[:2]] + [bad] + \
                [dataclasses.replace(r, rid=r.rid + "-b") for r in good[2:]]

        async def together():
            release = gate(engine)
            tasks = [asyncio.ensure_future(outcome(engine, r)) for r in batch]
            await asyncio.sleep(0)  # every task has submitted (submit is synchronous)
            release.set()
            return await asyncio.gather(*tasks)

        got = run(together())
        assert isolation_logged(caplog, "prefill", 5)  # they really shared one batch
        assert isinstance(got[2], EngineError) and got[2].status == 500
        assert got[:2] + got[3:] == alone
        assert until(lambda: engine.info()["pages_reserved"] == 0 and engine.info()["requests_live"] == 0)
    finally:
        engine.close()


def test_decode_step_with_a_bad_request(model, caplog):
    caplog.set_level(logging.WARNING, logger="fsm_pd.serving.isolate")
    engine = ColocatedEngine(model, num_pages=PAGES, page_size=PAGE_SIZE, max_prefill_batch=8)
    try:
        good = [request(f"d{i}", p, max_new_tokens=12, ignore_eos=True) for i, p in enumerate(prompts(model))]
        alone = [ids_of(run(generate(engine, r))) for r in good]
        victim = request("victim", prompts(model)[0], max_new_tokens=12, ignore_eos=True)

        async def together():
            release = gate(engine)
            tasks = [asyncio.ensure_future(outcome(engine, dataclasses.replace(r, rid=r.rid + "-b"))) for r in good]
            await asyncio.sleep(0)  # the tasks submit now, behind the gate: else the victim could run alone first
            stream = RequestStream(victim.rid)
            engine.submit(victim, stream)
            release.set()
            first = await anext(aiter(stream))  # the victim is decoding beside the others now
            # behind every check's back: a value no compiled sampler takes, from its next decode step on
            object.__setattr__(victim.sampling, "temperature", "not a number")
            with pytest.raises(EngineError) as failed:
                async for _ in stream:
                    pass
            return first, failed.value, await asyncio.gather(*tasks)

        first, failure, got = run(together())
        assert first.token_id == alone[0][0]
        assert failure.status == 500 and "decode step failed" in str(failure)
        assert isolation_logged(caplog, "decode step", 5)
        assert got == alone
        assert until(lambda: engine.info()["pages_reserved"] == 0 and engine.info()["requests_live"] == 0)
    finally:
        engine.close()


def test_prefill_node_batch_with_a_bad_request(model, tmp_path, caplog):
    caplog.set_level(logging.WARNING, logger="fsm_pd.serving.isolate")
    p = PrefillEngine(model, num_pages=PAGES, page_size=PAGE_SIZE, backend="fake", journal=str(tmp_path / "p.db"),
                      max_prefill_batch=8, **node_sockets(tmp_path, "p", bootstrap=True))
    d = DecodeEngine(model, num_pages=PAGES, page_size=PAGE_SIZE, backend="fake", secret=p.secret,
                     journal=str(tmp_path / "d.db"), **node_sockets(tmp_path, "d"))
    host, port = p.bootstrap_host_port
    rooms = iter(range(100, 1000))

    def routed(req):
        return dataclasses.replace(req, bootstrap=Bootstrap(host, port, next(rooms)))

    async def through_pd(req):
        prefill, decode = await asyncio.gather(outcome(p, req), outcome(d, req))
        return decode if not isinstance(prefill, EngineError) else prefill

    try:
        good = [request(f"p{i}", x, max_new_tokens=5) for i, x in enumerate(prompts(model))]
        alone = [run(through_pd(routed(r))) for r in good]
        batch = [routed(dataclasses.replace(r, rid=r.rid + "-b")) for r in good]
        batch.insert(1, routed(request("bad", [1, 2, BAD_TOKEN], max_new_tokens=5)))

        async def together():
            release = gate(p)
            tasks = [asyncio.ensure_future(through_pd(r)) for r in batch]
            # every room ready to prefill (the decode node has its pages) before the prefill node takes a batch
            ready = await asyncio.to_thread(until, lambda: all(
                p.manager.poll(r.bootstrap.room) is KVPoll.WaitingForInput for r in batch), 60)
            release.set()
            assert ready
            return await asyncio.gather(*tasks)

        got = run(together())
        assert isolation_logged(caplog, "prefill", 5)
        assert isinstance(got[1], EngineError) and got[1].status == 500
        assert got[:1] + got[2:] == alone
    finally:
        d.close()
        p.close()
