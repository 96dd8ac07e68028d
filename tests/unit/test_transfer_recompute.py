"""``--on-transfer-failure``: a decode node whose KV transfer fails after it reserved the pages prefills the prompt
itself and decodes on (``recompute``), or fails the request (``fail``). A prefill and a decode engine in one process
(real side channel and bootstrap server on 127.0.0.1, or unix sockets on a host without TCP: ``node_sockets.py``; the
``fake`` data plane); the failure is a fault injected into the decode node's pull or scatter."""

from __future__ import annotations

import asyncio
import time

import pytest
from node_sockets import node_sockets
from test_serving_colocated import PAGE_SIZE, PAGES, ids_of, run
from test_serving_pd import assert_idle, hold_model_thread, pd_request

from fsm_pd.cli.main import EXIT_OK, main
from fsm_pd.effects.faults import FaultConfig, Faults
from fsm_pd.machines import KVPoll
from fsm_pd.model.loader import load_model
from fsm_pd.serving.collect import generate
from fsm_pd.serving.decode_engine import DecodeEngine
from fsm_pd.serving.prefill_engine import PrefillEngine
from fsm_pd.serving.types import EngineError
from fsm_pd.store import read_journal

# two computations of the model compared (logits, greedy tokens): float32 products at full precision on a TPU
# too (tests/on_chip.py)
pytestmark = pytest.mark.usefixtures("full_precision")

PROMPTS = [[(7 * i + j) % 200 + 1 for j in range(n)] for i, n in enumerate((3, 9, 17, 30))]


@pytest.fixture(scope="module")
def model():
    return load_model("tiny")


def make_pair(model, tmp, policy):
    p = PrefillEngine(model, num_pages=PAGES, page_size=PAGE_SIZE, backend="fake", journal=str(tmp / "p.db"),
                      **node_sockets(tmp, "p", bootstrap=True))
    d = DecodeEngine(model, num_pages=PAGES, page_size=PAGE_SIZE, backend="fake", secret=p.secret,
                     journal=str(tmp / "d.db"), on_transfer_failure=policy, **node_sockets(tmp, "d"))
    return p, d


@pytest.fixture(scope="module")
def pair(model, tmp_path_factory):
    p, d = make_pair(model, tmp_path_factory.mktemp("recompute"), "recompute")
    yield p, d
    d.close()
    p.close()


def fail_stage(d: DecodeEngine, stage: str | None) -> None:
    """Make every later pull (or scatter) of ``d`` fail; None: none."""
    d.manager.effects.faults = Faults(FaultConfig(stages={} if stage is None else {stage: 1.0}), role="decode")


async def both(p, d, req):
    """What a router does: the same request to both nodes at once. Both answers (or their errors)."""
    return await asyncio.gather(generate(p, req), generate(d, req), return_exceptions=True)


async def concurrently(p, d, requests):
    return await asyncio.gather(*(both(p, d, r) for r in requests))


def final_rows(journal_path, rooms):
    last = {}
    for row in read_journal(journal_path):
        if row.room in rooms and row.role in ("prefill", "decode"):  # the rooms' own rows, not the recompute's
            last[row.room] = row
    return last


def journaled_recomputes(journal, rooms, timeout_s: float = 10.0) -> list:
    """The ``recompute`` rows of ``rooms`` once there is one for each (the node loop commits them a step after the
    recompute's prefill ran)."""
    deadline = time.monotonic() + timeout_s
    while True:
        rows = [r for r in read_journal(journal) if r.role == "recompute" and r.room in rooms]
        if len(rows) >= len(rooms) or time.monotonic() > deadline:
            return rows
        time.sleep(0.05)


@pytest.mark.parametrize("stage", ["pull", "scatter"])
def test_recompute_gives_the_undisturbed_greedy_output(pair, stage, capsys):
    p, d = pair
    fail_stage(d, None)
    want = [ids_of(run(both(p, d, pd_request(p, f"ok-{stage}-{i}", x, max_new_tokens=12)))[1])
            for i, x in enumerate(PROMPTS)]
    before = d.info()["recomputes"]
    fail_stage(d, stage)
    requests = [pd_request(p, f"bad-{stage}-{i}", x, max_new_tokens=12) for i, x in enumerate(PROMPTS)]
    began = time.monotonic()
    try:
        got = run(concurrently(p, d, requests))
    finally:
        fail_stage(d, None)
    took = time.monotonic() - began
    for (prefill_out, decode_out), expected in zip(got, want, strict=True):
        assert not isinstance(decode_out, BaseException), decode_out
        assert ids_of(decode_out) == expected
        recompute = decode_out[-1].meta["kv_recompute"]
        assert f"injected fault: {stage} failed" in recompute["reason"]
        assert 0 < recompute["seconds"] <= took  # how long the recompute took: within the requests' own time
        # its route receipt, which the X-FSM-PD-Route headers of every answer come from (api/streaming.py)
        assert decode_out[-1].meta["pd_route"] == {"path": "pd", "reason": "", "prefill": None, "pages": 0,
                                                   "bytes": 0}
        # the prefill leg is answered too (a router would otherwise drop the decode's answer for its error)
        assert not isinstance(prefill_out, BaseException), prefill_out
        assert "the decode node recomputes" in prefill_out[0].meta["kv_transfer_failed"]
    assert d.info()["recomputes"] - before == len(PROMPTS)
    assert_idle(p, d)
    # the rooms still ended Failed on both sides, with the injected fault as the reason
    rooms = {r.bootstrap.room for r in requests}
    for journal in (d.manager.journal.url, p.manager.journal.url):
        last = final_rows(journal, rooms)
        assert set(last) == rooms and {row.dst for row in last.values()} == {"Failed"}
    metrics = d.registry.get_sample_value("fsm_pd_transfer_recomputes_total",
                                                          {"role": "decode", "node": "decode-0"})
    assert metrics == d.info()["recomputes"]
    # each recompute is journaled beside its failed room, and replay tells the request's real end (issue 51)
    records = journaled_recomputes(d.manager.journal.url, rooms)
    assert sorted(r.room for r in records) == sorted(rooms) and {r.dst for r in records} == {"Success"}
    assert {r.event["rid"] for r in records} == {r.rid for r in requests}
    capsys.readouterr()
    assert main(["replay", d.manager.journal.url, p.manager.journal.url, "--request", requests[0].rid]) == EXIT_OK
    story = capsys.readouterr().out.replace("\n", " ")
    assert "failed its transfer after" in story and "answered by decode decode-0 after recompute" in story, story


def test_fail_policy_fails_the_request(model, tmp_path):
    p, d = make_pair(model, tmp_path, "fail")
    try:
        fail_stage(d, "pull")
        prefill_out, decode_out = run(both(p, d, pd_request(p, "fails", PROMPTS[1], max_new_tokens=4)))
        assert isinstance(decode_out, EngineError) and decode_out.status == 500
        assert "injected fault: pull failed" in str(decode_out)
        assert isinstance(prefill_out, EngineError) and "the decode node recomputes" not in str(prefill_out)
        assert d.info()["recomputes"] == 0
        assert_idle(p, d)
    finally:
        d.close()
        p.close()


@pytest.mark.parametrize("policy", ["fail", "recompute"])
def test_a_room_whose_prefill_node_died_answers_502_or_is_recomputed(model, tmp_path, policy):
    """The prefill node found dead while the room waits for its READY (a READY lost with the dead process leaves it
    there): ``fail`` answers 502 with the reason (the peer's failure, not this node's: the router retries it like any
    5xx); ``recompute`` prefills the prompt here and answers what an undisturbed run gives, since a retry may find no
    prefill node left to go to (the killed-prefill drill on a loaded host)."""
    p, d = make_pair(model, tmp_path, policy)
    want = ids_of(run(both(p, d, pd_request(p, "undisturbed", PROMPTS[1], max_new_tokens=4)))[1])
    req = pd_request(p, "peer-dies", PROMPTS[1], max_new_tokens=4)
    room = req.bootstrap.room
    release = hold_model_thread(p)  # P cannot prefill: D's room waits in WaitingForInput for its READY
    died = "prefill node at p missed 2 heartbeats 1 s apart: it died, hangs or cannot be reached"

    async def scenario():
        prefill = asyncio.ensure_future(generate(p, req))
        decode = asyncio.ensure_future(generate(d, req))
        while d.manager.poll(room) != KVPoll.WaitingForInput:
            await asyncio.sleep(0.01)
        d.manager.node.submit(room, "peer_failed", {"reason": died})  # what D's PeerWatch submits
        on_d = await asyncio.gather(decode, return_exceptions=True)
        p.abort("peer-dies")
        release.set()
        return on_d[0], (await asyncio.gather(prefill, return_exceptions=True))[0]

    try:
        on_d, _ = run(scenario())
        if policy == "fail":
            assert isinstance(on_d, EngineError) and on_d.status == 502, on_d
            assert f"peer failed: {died}" in str(on_d)
            assert d.info()["recomputes"] == 0
        else:
            assert ids_of(on_d) == want, on_d
            assert f"peer failed: {died}" in on_d[-1].meta["kv_recompute"]["reason"]
            assert d.info()["recomputes"] == 1
        assert final_rows(d.manager.journal.url, {room})[room].dst == "Failed"  # the room's own end stays the same
        assert_idle(p, d)
    finally:
        release.set()
        d.close()
        p.close()


def test_unknown_policy_is_refused(model):
    with pytest.raises(ValueError, match="on_transfer_failure"):
        DecodeEngine(model, num_pages=PAGES, page_size=PAGE_SIZE, backend="fake", on_transfer_failure="retry")
