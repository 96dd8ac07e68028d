"""A prefill node hands a chunked prompt over piece by piece while its later chunks compute (effects/chunked.py):
the answer is the whole prefill's, the journal and replay show every chunk, and a piece that fails or an abort
mid-way leaves nothing held on either node."""

from __future__ import annotations

import asyncio
import dataclasses
import re
import threading
import time

import pytest
from node_sockets import node_sockets
from test_chunked_prefill import CHUNK
from test_chunked_prefill import model as model  # noqa: F401 - the fixture: the tiny model with sharp attention
from test_serving_colocated import PAGE_SIZE, PAGES, ids_of, request, run, until
from test_serving_pd import pd_request, through_pd

from fsm_pd.machines.states import KVPoll
from fsm_pd.serving.collect import generate
from fsm_pd.serving.colocated_engine import ColocatedEngine
from fsm_pd.serving.decode_engine import DecodeEngine
from fsm_pd.serving.prefill_engine import PrefillEngine
from fsm_pd.store import read_journal, replay
from fsm_pd.transport.backends.base import TransferFailed

# two computations of the model compared (logits, greedy tokens): float32 products at full precision on a TPU
# too (tests/on_chip.py)
pytestmark = [pytest.mark.chip, pytest.mark.usefixtures("full_precision")]  # chip: tests/on_tpu.sh

CHUNKS = 6  # chunks of the long prompt: pieces of CHUNK / PAGE_SIZE pages, each published once computed


def long_prompt(tokenizer, n: int = CHUNKS * CHUNK - 5) -> list[int]:
    ids = tokenizer.encode("every chunk of this prompt travels while the next one computes; " * 20)
    assert len(ids) >= n
    return ids[:n]


def pd_pair(model, tmp_path, *, on_transfer_failure="fail"):
    p = PrefillEngine(model, num_pages=PAGES, page_size=PAGE_SIZE, backend="fake", journal=str(tmp_path / "p.db"),
                      chunked_prefill_size=CHUNK, radix_cache=False, **node_sockets(tmp_path, "p", bootstrap=True))
    d = DecodeEngine(model, num_pages=PAGES, page_size=PAGE_SIZE, backend="fake", secret=p.secret,
                     journal=str(tmp_path / "d.db"), on_transfer_failure=on_transfer_failure,
                     **node_sockets(tmp_path, "d"))
    return p, d


@pytest.fixture(scope="module")
def warmed(model, tmp_path_factory):
    """One whole chunked handoff first, on engines like the tests' (the same pool, chunk and prompt), so that the
    programs a handoff runs (each chunk's prefill, the gathers, the scatters, the KV checksum of each piece bucket,
    the decode step) are compiled before a test whose deadlines are under a second counts: on a chip each compiles
    for seconds on the first handoff. Warmed, not scaled: the deadlines stay what the tests say."""
    p, d = pd_pair(model, tmp_path_factory.mktemp("warm"))
    try:
        run(through_pd(p, d, pd_request(p, "warm", long_prompt(model.tokenizer), max_new_tokens=4, ignore_eos=True)))
        assert nothing_held(p, d)
    finally:
        d.close()
        p.close()


def nothing_held(*engines) -> bool:
    def idle(e):
        leaks = e.info()["leaks"]
        return all(v == 0 for k, v in leaks.items() if k != "pages_free")  # pages_reserved among them
    return until(lambda: all(idle(e) for e in engines))


def events(path, trigger):
    return [r for r in read_journal(path) if r.trigger == trigger]


def publish_between_chunks(p) -> None:
    """Make every chunk's publish job run before the next chunk computes, as on a model slower than the tiny one:
    the step that reported a chunk waits until the node loop took the chunk's event and queued its job on the model
    thread (ahead of the next step, which is queued when this one returns), or the room ended. It waits on what the
    loop did, not on the room's state as the step found it: the room is still WaitingForInput until the loop takes
    the first chunk's event, and a wait that ended there let a loaded machine compute the whole prompt before the
    loop ran, so that READY went out after the last chunk."""
    effects, queued = p.manager.effects, threading.Semaphore(0)
    submit = effects.model.submit
    ended = (None, KVPoll.Success, KVPoll.Failed)  # None: the room is gone

    def counted(job):
        future = submit(job)
        queued.release()
        return future

    effects.model = type("Counted", (), {"submit": staticmethod(counted)})()

    def waiting(report):
        def reported(room, *args, **kw):
            report(room, *args, **kw)
            # a room that ended meanwhile ignores the chunk: no job comes
            while not queued.acquire(timeout=0.01) and p.manager.poll(room) not in ended:
                pass
        return reported

    p.manager.kv_first_chunk, p.manager.kv_chunk = waiting(p.manager.kv_first_chunk), waiting(p.manager.kv_chunk)


def test_chunk_by_chunk_handoff_answers_as_a_whole_prefill_and_replay_shows_the_chunks(model, tmp_path):
    whole = ColocatedEngine(model, num_pages=PAGES, page_size=PAGE_SIZE, chunked_prefill_size=512, radix_cache=False)
    p, d = pd_pair(model, tmp_path)
    publish_between_chunks(p)
    try:
        prompt = long_prompt(model.tokenizer)
        want = ids_of(run(generate(whole, request("w", prompt, max_new_tokens=8, ignore_eos=True))))
        got = ids_of(run(through_pd(p, d, pd_request(p, "g", prompt, max_new_tokens=8, ignore_eos=True))))
        assert got == want
        assert nothing_held(p, d), (p.info()["leaks"], d.info()["leaks"])
    finally:
        d.close()
        p.close()
        whole.close()
    pages = -(-len(prompt) // PAGE_SIZE)
    (ready,) = events(tmp_path / "p.db", "kv_ready")
    assert ready.dst == "Transferring" and ready.event["piece_pages"] == CHUNK // PAGE_SIZE
    assert ready.event["final_pages"] == CHUNK // PAGE_SIZE  # READY went out after the first chunk
    chunks = events(tmp_path / "p.db", "kv_chunk")
    assert len(chunks) == CHUNKS - 1 and all(r.src == r.dst == "Transferring" for r in chunks)
    assert [r.event["final_pages"] for r in chunks] == [k * CHUNK // PAGE_SIZE for k in range(2, CHUNKS)] + [pages]
    assert chunks[-1].event["last"] and chunks[-1].event["first_token"] == want[0]
    (published,) = events(tmp_path / "p.db", "published")
    assert published.seq < chunks[-1].seq  # READY went out while the prompt was still computing
    assert published.event["chunks"] == CHUNKS
    (pulled,) = events(tmp_path / "d.db", "pulled")
    assert len(pulled.event["chunks"]) == CHUNKS and pulled.event["first_token"] == want[0]
    details = [e.get("detail", "") for side in (tmp_path / "p.db", tmp_path / "d.db")
               for report in replay(read_journal(side)).rooms for e in report.events]
    assert sum("chunk" in text for text in details) == CHUNKS  # the first and every later chunk, on P
    assert any(f"{CHUNKS} pieces (" in text for text in details)


def test_a_short_prompt_and_a_logprobs_request_keep_the_whole_handoff(model, tmp_path):
    p, d = pd_pair(model, tmp_path)
    try:
        short = long_prompt(model.tokenizer, CHUNK - 3)
        run(through_pd(p, d, pd_request(p, "short", short, max_new_tokens=2)))
        req = pd_request(p, "lp", long_prompt(model.tokenizer), max_new_tokens=2)
        run(through_pd(p, d, dataclasses.replace(req, return_logprob=True)))
        assert nothing_held(p, d)
    finally:
        d.close()
        p.close()
    assert not events(tmp_path / "p.db", "kv_chunk")
    assert all("chunks" not in r.event for r in events(tmp_path / "p.db", "published"))


def test_a_prompt_whose_chunks_outlast_the_handoff_deadlines_is_handed_over_once(model, warmed, tmp_path):
    """Every chunk comes well within P's pull_hold and D's transfer deadline, the whole prompt well past them: each
    chunk restarts P's (``kv_chunk``) and each piece that lands restarts D's (``piece_pulled``), so the handoff
    follows progress and the prompt is computed once, on P. Counted from the first chunk, a 7,400-token chat failed
    its handoff at exactly 60 s while P still computed it, and was computed again by D and by a retry."""
    p = PrefillEngine(model, num_pages=PAGES, page_size=PAGE_SIZE, backend="fake", journal=str(tmp_path / "p.db"),
                      chunked_prefill_size=CHUNK, radix_cache=False, deadlines={"pull_hold": 0.8},
                      **node_sockets(tmp_path, "p", bootstrap=True))
    d = DecodeEngine(model, num_pages=PAGES, page_size=PAGE_SIZE, backend="fake", secret=p.secret,
                     journal=str(tmp_path / "d.db"), on_transfer_failure="recompute", deadlines={"transfer": 0.8},
                     **node_sockets(tmp_path, "d"))
    report = p.manager.kv_chunk

    def slow_chunk(*args, **kw):  # the model thread: a chunk of a long prompt on a slow model
        time.sleep(0.3)
        report(*args, **kw)

    p.manager.kv_chunk = slow_chunk
    try:
        started = time.monotonic()
        got = ids_of(run(through_pd(p, d, pd_request(p, "slow", long_prompt(model.tokenizer), max_new_tokens=4,
                                                     ignore_eos=True))))
        assert len(got) == 4 and time.monotonic() - started > 1.2  # 5 later chunks, 0.3 s each: past both deadlines
        assert d.info()["recomputes"] == 0  # the decode node did not compute it again
        assert nothing_held(p, d), (p.info()["leaks"], d.info()["leaks"])
    finally:
        d.close()
        p.close()
    assert {r.dst for r in read_journal(tmp_path / "p.db") + read_journal(tmp_path / "d.db")} >= {"Success"}
    assert not [r for r in read_journal(tmp_path / "p.db") + read_journal(tmp_path / "d.db") if r.dst == "Failed"]
    assert len(events(tmp_path / "d.db", "piece_pulled")) == CHUNKS  # every piece restarted D's deadline


@pytest.mark.parametrize("first", ["decode", "prefill"])
def test_a_chunked_handoff_that_fails_mid_way_is_computed_again_in_one_place_only(model, warmed, tmp_path, first):
    """One chunk stalls past a deadline mid-way. D's transfer deadline first (the room's or the stalled piece's
    pull's, both of that length): D recomputes the prompt, and P answers its leg (200, ``kv_transfer_failed``) as it
    does for a whole handoff, where it failed it (having no first token yet), so a router computed the prompt a
    second time. P's pull_hold first: both rooms fail and D does not recompute (the pull of the entry P failed came
    before P's ABORT and D recomputed it, while a router retried P's failure), so only a router's retry computes it
    again."""
    whole = ColocatedEngine(model, num_pages=PAGES, page_size=PAGE_SIZE, chunked_prefill_size=512, radix_cache=False)
    p = PrefillEngine(model, num_pages=PAGES, page_size=PAGE_SIZE, backend="fake", journal=str(tmp_path / "p.db"),
                      chunked_prefill_size=CHUNK, radix_cache=False,
                      deadlines={"pull_hold": 0.5 if first == "prefill" else 5.0},
                      **node_sockets(tmp_path, "p", bootstrap=True))
    d = DecodeEngine(model, num_pages=PAGES, page_size=PAGE_SIZE, backend="fake", secret=p.secret,
                     journal=str(tmp_path / "d.db"), on_transfer_failure="recompute",
                     deadlines={"transfer": 0.5 if first == "decode" else 5.0}, **node_sockets(tmp_path, "d"))
    report, reported = p.manager.kv_chunk, []

    def stalling(*args, **kw):  # the model thread: the third chunk stalls
        reported.append(args)
        if len(reported) == 2:
            time.sleep(1.2)
        report(*args, **kw)

    p.manager.kv_chunk = stalling
    try:
        prompt = long_prompt(model.tokenizer)
        want = ids_of(run(generate(whole, request("w", prompt, max_new_tokens=4, ignore_eos=True))))

        async def both():
            req = pd_request(p, "stall", prompt, max_new_tokens=4, ignore_eos=True)
            return await asyncio.gather(generate(p, req), generate(d, req), return_exceptions=True)

        on_p, on_d = run(both())
        if first == "decode":
            assert not isinstance(on_p, Exception), on_p
            # D's transfer deadline, on either of its two clocks: the room's, restarted when the loop takes the
            # last piece's piece_pulled, or the stalled piece's pull, started on a worker as that piece landed. Which
            # runs out first depends on how far the loop lags: on a loaded machine, now and then the pull's
            why = on_p[-1].meta["kv_transfer_failed"]
            assert re.match(r"aborted by peer: (transfer timeout|timeout error: pull timed out: chunk piece \d )",
                            why), why
            assert ids_of(on_d) == want and d.info()["recomputes"] == 1
        else:
            assert isinstance(on_p, Exception) and "pull_hold timeout" in str(on_p), on_p
            assert isinstance(on_d, Exception) and d.info()["recomputes"] == 0, on_d
        assert nothing_held(p, d), (p.info()["leaks"], d.info()["leaks"])
    finally:
        d.close()
        p.close()
        whole.close()


@pytest.mark.parametrize("how", ["failed piece", "failed pull", "abort"])
def test_a_handoff_ended_mid_way_frees_everything_on_both_nodes(model, tmp_path, how):
    """The third piece fails to publish on P, or its pull fails on D, or the client aborts while the third chunk
    waits to be published: both rooms end Failed, and every page, staging entry and landed piece is let go on both
    nodes."""
    p, d = pd_pair(model, tmp_path)
    publish_between_chunks(p)  # so that the third piece is published while the later chunks are still to compute
    publish, seen = p.manager.effects.transfer.publish, []
    pull, pulls = d.manager.effects.puller.pull, []

    def third_fails(uuid, staging, hold_s):
        seen.append(uuid)
        if len(seen) == 3 and how == "abort":
            p.abort("mid")
        if len(seen) == 3 and how == "failed piece":
            raise RuntimeError("the third piece could not be published")
        publish(uuid, staging, hold_s)

    def third_pull_fails(address, uuid, page_count, timeout_s, *, done, **kw):
        pulls.append(uuid)
        if len(pulls) == 3 and how == "failed pull":
            done(None, TransferFailed("the link went down"))
            return
        pull(address, uuid, page_count, timeout_s, done=done, **kw)

    p.manager.effects.transfer.publish = third_fails
    d.manager.effects.puller.pull = third_pull_fails
    try:
        prompt = long_prompt(model.tokenizer)

        async def both():
            req = pd_request(p, "mid", prompt, max_new_tokens=4, ignore_eos=True)
            return await asyncio.gather(generate(p, req), generate(d, req), return_exceptions=True)

        outcomes = run(both())
        assert all(isinstance(o, Exception) for o in outcomes), outcomes
        if how == "failed piece":
            assert len(seen) == 3, seen  # a failed piece is never retried by a later chunk
        if how == "failed pull":
            assert len(pulls) == 3, pulls  # and nothing is pulled after a failed piece
        assert nothing_held(p, d), (p.info()["leaks"], d.info()["leaks"])
        assert not p.manager.effects.staging and not p.manager.effects.chunks_sent
        assert not d.manager.effects.pending and not d.manager.effects.pulled
    finally:
        d.close()
        p.close()
    ends = [r for r in read_journal(tmp_path / "p.db") + read_journal(tmp_path / "d.db") if r.dst == "Failed" != r.src]
    assert len(ends) == 2 and all(r.src == "Transferring" for r in ends)
    if how == "failed pull":  # D failed the room for the piece at once, it did not wait for its deadline
        (mine,) = [r for r in ends if r.role == "decode"]
        assert mine.trigger == "error" and "chunk piece 2 (8 pages): the link went down" in mine.payload["reason"]



def test_a_stray_chunk_event_on_a_room_handed_over_whole_starts_no_second_handoff(model, tmp_path):
    """``kv_chunk`` is accepted in Transferring whatever started it; on a room whose prompt goes whole it must not
    gather and publish the pages again (a second staging entry that nothing would ever release)."""
    p, d = pd_pair(model, tmp_path)
    effects, rooms = p.manager.effects, []
    for name in ("publish", "publish_progressive"):  # the whole handoff's publish: a stray chunk event arrives now
        def stray(*args, _publish=getattr(effects.transfer, name)):  # noqa: B008 - bound now, per name
            if not rooms:  # the data's publish (the KV checksum's entry follows it, from another thread)
                (room,) = effects.staging
                rooms.append(room)
                p.manager.kv_chunk(room, final_pages=1)
            return _publish(*args)
        setattr(effects.transfer, name, stray)
    try:
        req = pd_request(p, "stray", long_prompt(model.tokenizer, CHUNK - 3), max_new_tokens=2)
        run(through_pd(p, d, req))
        assert nothing_held(p, d), (p.info()["leaks"], d.info()["leaks"])
    finally:
        d.close()
        p.close()
    (stray,) = events(tmp_path / "p.db", "kv_chunk")
    assert rooms == [stray.room] and stray.src == stray.dst == "Transferring"
    assert len(events(tmp_path / "p.db", "published")) == 1
