"""A node's local path (``fsm_pd/serving/local_path.py``) runs on programs its ready set already holds: a request the
router sends whole must not compile while serving, on a decode node or on a prefill node that serves both roles."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest
from node_sockets import node_sockets
from test_serving_colocated import PAGE_SIZE, PAGES, ids_of, request, run
from test_serving_pd import assert_idle, pd_request, through_pd

from fsm_pd.model.loader import load_model
from fsm_pd.serving.collect import generate
from fsm_pd.serving.decode_engine import DecodeEngine
from fsm_pd.serving.prefill_engine import PrefillEngine
from fsm_pd.serving.types import Bootstrap, EngineError
from fsm_pd.serving.warmup_plan import SHORT_PROMPT_TOKENS, plan_for
from fsm_pd.store import read_journal

# two computations of the model compared (logits, greedy tokens): float32 products at full precision on a TPU
# too (tests/on_chip.py)
pytestmark = pytest.mark.usefixtures("full_precision")


def _decode_shapes(shapes) -> set:
    return {shape for shape in shapes if shape[1] == 1}


def test_the_ready_sets_cover_a_local_prefill_and_its_decode(tmp_path):
    engines = {"prefill": PrefillEngine("tiny", num_pages=64, bootstrap_port=None,
                                        **node_sockets(tmp_path, "p", bootstrap=True)),
               "both": PrefillEngine("tiny", num_pages=64, bootstrap_port=None, serve_local=True,
                                     **node_sockets(tmp_path, "b", bootstrap=True)),
               "decode": DecodeEngine("tiny", num_pages=64, **node_sockets(tmp_path, "d"))}
    try:
        plans = {name: plan_for(engine) for name, engine in engines.items()}
        assert not _decode_shapes(plans["prefill"].forward)  # a prefill node that does not decode compiles no step
        for name in ("both", "decode"):
            ready = plans[name].ready_forward
            # the single-row decode step, and the longest single-row prefill that covers every local prompt
            assert (1, 1) in ready
            longest = max(tokens for rows, tokens in plans[name].forward if rows == 1 and tokens > 1)
            assert (1, longest) in ready and longest >= engines[name].recompute.max_tokens
        assert plans["both"].gather_buckets == plans["prefill"].gather_buckets  # still a prefill node's transfers
        # every node has a short prompt's prefill ready too: a decode node prefills the short prompts the router's
        # default policy serves whole on it (padded to the longest prefill, a chat turn costs 8x on SmolLM2)
        for name in ("prefill", "both", "decode"):
            assert (1, SHORT_PROMPT_TOKENS) in plans[name].ready_forward
    finally:
        for engine in engines.values():
            engine.close()


# --- the local path in process: a prefill node that serves both roles and a decode node (the fake data plane) ---

PROMPTS = [[(5 * i + j) % 200 + 1 for j in range(n)] for i, n in enumerate((2, 5, 9, 16, 23, 40))]
_rooms = iter(range(50_000, 10**6))


@pytest.fixture(scope="module")
def nodes(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("local_path")
    model = load_model("tiny")
    p = PrefillEngine(model, num_pages=PAGES, page_size=PAGE_SIZE, backend="fake", journal=str(tmp / "p.db"),
                      serve_local=True, **node_sockets(tmp, "p", bootstrap=True))
    d = DecodeEngine(model, num_pages=PAGES, page_size=PAGE_SIZE, backend="fake", secret=p.secret,
                     journal=str(tmp / "d.db"), **node_sockets(tmp, "d"))
    yield p, d, tmp
    d.close()
    p.close()


def local_request(rid, ids, **sampling):
    route = {"path": "local", "reason": "test"}
    return dataclasses.replace(request(rid, ids, max_new_tokens=6, **sampling), route=route,
                               bootstrap=Bootstrap("", 0, next(_rooms), local=True))


def test_a_request_served_whole_on_either_node_gives_the_pd_tokens(nodes):
    p, d, _ = nodes

    async def go():
        out = []
        for i, ids in enumerate(PROMPTS):
            through = await through_pd(p, d, pd_request(p, f"pd{i}", ids, max_new_tokens=6))
            on_d = await generate(d, local_request(f"d{i}", ids))
            on_p = await generate(p, local_request(f"p{i}", ids))
            out.append((ids_of(through), ids_of(on_d), ids_of(on_p)))
        return out

    for through, on_d, on_p in run(go()):
        assert through == on_d == on_p and len(through) == 6
    assert_idle(p, d)
    assert not p._local_rooms and not d._local_rooms


def test_cancelled_local_requests_leave_nothing_behind(nodes):
    """Aborted before their prefill (still queued) and mid-decode: pages, live requests and the rooms of live local
    requests all go back; only the prefilled ones are journaled, each once."""
    p, d, tmp = nodes
    free = {e: e.info()["pages_free"] for e in (p, d)}

    async def go():
        tasks, reqs = [], []
        for i, ids in enumerate(PROMPTS * 2):
            for engine in (p, d):
                req = local_request(f"c{engine.role}{i}", ids, ignore_eos=True)
                req.sampling = dataclasses.replace(req.sampling, max_new_tokens=200)
                reqs.append((engine, req))
                tasks.append(asyncio.ensure_future(generate(engine, req)))
        await asyncio.sleep(0)  # every submit ran: some are queued, none finished (200 tokens each)
        for k, (engine, req) in enumerate(reqs):
            if k % 2 == 0:
                assert engine.abort(req.rid, room=req.bootstrap.room)
        return await asyncio.gather(*tasks, return_exceptions=True)

    results = run(go())
    aborted = [r for r in results if isinstance(r, EngineError)]
    assert len(aborted) == len(results) // 2 and all(e.status == 499 for e in aborted)
    assert all(len(r) == 200 for r in results if not isinstance(r, BaseException))
    assert_idle(p, d)
    assert {e: e.info()["pages_free"] for e in (p, d)} == free
    assert not p._local_rooms and not d._local_rooms
    for engine in (p, d):
        rows = [r for r in read_journal(str(tmp / f"{engine.role[0]}.db")) if r.role == "local"]
        assert len({r.room for r in rows}) == len(rows)  # each once
        assert all(r.dst == "Success" for r in rows)


def test_a_local_room_used_twice_is_refused(nodes):
    p, d, _ = nodes
    first = local_request("twice", PROMPTS[1])
    run(generate(d, first))
    with pytest.raises(EngineError) as refused:
        run(generate(d, dataclasses.replace(first, rid="twice-again")))
    assert refused.value.status == 409
