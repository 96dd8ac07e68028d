"""The prefix cache in the engines: multi-turn conversations answer token for token as without it, colocated and
through PD, while later turns compute only what is new; pressure evicts the cache before anything fails; idle nodes
hold no reservation and no lock."""

from __future__ import annotations

import asyncio

import pytest
from node_sockets import node_sockets
from test_serving_colocated import PAGE_SIZE, PAGES, ids_of, request, run, until
from test_serving_pd import pd_request, through_pd

from fsm_pd.model.loader import LoadedModel, load_model
from fsm_pd.model.params import random_params
from fsm_pd.serving.collect import generate
from fsm_pd.serving.colocated_engine import ColocatedEngine
from fsm_pd.serving.decode_engine import DecodeEngine
from fsm_pd.serving.prefill_engine import PrefillEngine
from fsm_pd.store import read_journal, replay

# two computations of the model compared (logits, greedy tokens): float32 products at full precision on a TPU
# too (tests/on_chip.py)
pytestmark = pytest.mark.usefixtures("full_precision")

TURNS = 4


@pytest.fixture(scope="module")
def model():
    """The tiny model with weights five times larger: its attention is sharp, so a page in the wrong place (or
    stale KV) changes the answer. The stock tiny model attends almost uniformly and hardly notices the order."""
    tiny = load_model("tiny")
    return LoadedModel("tiny-sharp", tiny.config, random_params(tiny.config, seed=0, std=0.5), tiny.tokenizer)


def conversations(tokenizer, count: int) -> list[tuple[list[int], list[list[int]]]]:
    """(a shared system prompt, each turn's new user tokens) per conversation."""
    system = tokenizer.encode("You are a terse assistant. Answer in one short line, and never apologise. " * 2)
    return [(system, [tokenizer.encode(f"user {c} says turn {t}: what next?") for t in range(TURNS)])
            for c in range(count)]


def play(answer, system, users) -> tuple[list[list[int]], list[int]]:
    """Each turn's output ids, and each turn's cached prompt tokens; a turn's prompt is the last prompt, its answer
    and the new user tokens (as a chat client resends the history)."""
    history, outputs, cached = list(system), [], []
    for user in users:
        prompt = history + user
        outs = answer(prompt)
        outputs.append(ids_of(outs))
        cached.append(outs[-1].meta.get("cached_tokens", 0))
        history = prompt + ids_of(outs)
    return outputs, cached


def settled(engine) -> bool:
    info = engine.info()
    return info["requests_live"] == 0 and info["pages_reserved"] == 0 and info.get("cached_pages_locked", 0) == 0


def test_colocated_conversations_answer_the_same_and_later_turns_compute_less(model):
    chats = conversations(model.tokenizer, 3)
    plain = ColocatedEngine(model, num_pages=PAGES, page_size=PAGE_SIZE, radix_cache=False)
    cached = ColocatedEngine(model, num_pages=PAGES, page_size=PAGE_SIZE)
    try:
        for c, (system, users) in enumerate(chats):
            ask = lambda engine, tag, c=c: lambda prompt: run(generate(engine, request(
                f"{tag}{c}-{len(prompt)}", prompt, max_new_tokens=6, ignore_eos=True)))
            want, none = play(ask(plain, "p"), system, users)
            got, hits = play(ask(cached, "c"), system, users)
            assert got == want, f"conversation {c}: the cache changed the answer"
            assert none == [0] * TURNS
            # the system prompt is cached from the second conversation on; every later turn reuses its history
            assert all(hit >= len(system) // PAGE_SIZE * PAGE_SIZE for hit in hits[1:]) and (c == 0 or hits[0] > 0)
        assert until(lambda: settled(cached))
        info = cached.info()
        assert info["prefill_cached_tokens"] > info["prefill_computed_tokens"] / 2
        assert info["pages_free"] == PAGES - 1 and info["pages_cached"] > 0  # cached pages are reclaimable
        assert cached.flush_cache()[0] and cached.info()["cached_pages"] == 0 and cached.info()["pages_cached"] == 0
    finally:
        plain.close()
        cached.close()


def test_pd_conversations_answer_like_colocated_with_the_cache_on_the_prefill_node(model, tmp_path):
    chats = conversations(model.tokenizer, 2)
    colocated = ColocatedEngine(model, num_pages=PAGES, page_size=PAGE_SIZE, radix_cache=False)
    p = PrefillEngine(model, num_pages=PAGES, page_size=PAGE_SIZE, backend="fake", journal=str(tmp_path / "p.db"),
                      **node_sockets(tmp_path, "p", bootstrap=True))
    d = DecodeEngine(model, num_pages=PAGES, page_size=PAGE_SIZE, backend="fake", secret=p.secret,
                     journal=str(tmp_path / "d.db"), **node_sockets(tmp_path, "d"))
    try:
        for c, (system, users) in enumerate(chats):
            want, _ = play(lambda x, c=c: run(generate(colocated, request(f"w{c}-{len(x)}", x, max_new_tokens=6,
                                                                          ignore_eos=True))), system, users)
            got, hits = play(lambda x, c=c: run(through_pd(p, d, pd_request(p, f"g{c}-{len(x)}", x,
                                                                             max_new_tokens=6, ignore_eos=True))),
                             system, users)
            assert got == want and all(hit > 0 for hit in hits[1:])  # the decode node tells the prefill's hits
        assert p.info()["prefill_cached_tokens"] > 0 and until(lambda: settled(p) and settled(d))
    finally:
        d.close()
        p.close()
        colocated.close()


def test_a_small_pool_evicts_the_cache_and_serves_everything_the_same(model):
    """Many distinct prompts over a pool that cannot keep them: the cache gives its pages back (least recently used
    first) instead of failing or retracting a request, and the answers do not change."""
    prompts = [model.tokenizer.encode(f"prompt number {i} " * 6) for i in range(24)]
    small = 40  # pages of 4 tokens: about six of these prompts' worth
    plain = ColocatedEngine(model, num_pages=small, page_size=PAGE_SIZE, radix_cache=False)
    cached = ColocatedEngine(model, num_pages=small, page_size=PAGE_SIZE)

    async def all_of(engine, tag):
        return await asyncio.gather(*(generate(engine, request(f"{tag}{i}", x, max_new_tokens=4, ignore_eos=True))
                                      for i, x in enumerate(prompts)))

    try:
        want = [ids_of(o) for o in run(all_of(plain, "p"))]
        got = [ids_of(o) for o in run(all_of(cached, "c"))]
        assert got == want
        assert until(lambda: settled(cached))
        info = cached.info()
        assert info["prefix_evicted_pages"] > 0 and info["preempted"] == 0 and info["pages_free"] == small - 1
    finally:
        plain.close()
        cached.close()


def test_a_decode_cache_has_the_prefill_send_only_what_it_lacks(model, tmp_path):
    """With the decode node's own cache, later turns move only the pages after the prefix it holds; a prompt it
    holds whole (a page multiple) moves no page at all; the answers are colocated's."""
    chats = conversations(model.tokenizer, 1)
    colocated = ColocatedEngine(model, num_pages=PAGES, page_size=PAGE_SIZE, radix_cache=False)
    p = PrefillEngine(model, num_pages=PAGES, page_size=PAGE_SIZE, backend="fake", journal=str(tmp_path / "p.db"),
                      **node_sockets(tmp_path, "p", bootstrap=True))
    d = DecodeEngine(model, num_pages=PAGES, page_size=PAGE_SIZE, backend="fake", secret=p.secret,
                     journal=str(tmp_path / "d.db"), radix_cache=True, **node_sockets(tmp_path, "d"))
    sent = []
    d.manager.node.observers.append(lambda room, decision, at: sent.append(room.ctx["page_count"])
                                    if decision.trigger == "kv_published" else None)
    try:
        system, users = chats[0]
        want, _ = play(lambda x: run(generate(colocated, request(f"w{len(x)}", x, max_new_tokens=6,
                                                                 ignore_eos=True))), system, users)
        got, _ = play(lambda x: run(through_pd(p, d, pd_request(p, f"g{len(x)}", x, max_new_tokens=6,
                                                                ignore_eos=True))), system, users)
        assert got == want
        # the first turn moves its whole prompt; a later one its new tokens (the last answer, the user's turn) and at
        # most one page of the history that ended mid-page
        assert sent[0] == -(-len(system + users[0]) // PAGE_SIZE)
        for turn in range(1, TURNS):
            new = len(want[turn - 1]) + len(users[turn])
            assert sent[turn] <= -(-new // PAGE_SIZE) + 1, (turn, sent)
        whole = system[: len(system) // PAGE_SIZE * PAGE_SIZE]  # a prompt the decode node holds entirely
        again = run(through_pd(p, d, pd_request(p, "again", whole, max_new_tokens=3, ignore_eos=True)))
        assert sent[-1] == 0 and ids_of(again) == ids_of(run(generate(colocated, request(
            "again-c", whole, max_new_tokens=3, ignore_eos=True))))
        assert until(lambda: settled(p) and settled(d)) and d.info()["cached_pages"] > 0
        # the journals say it too, room by room: replay shows what crossed and what each cache held
        rooms = replay(read_journal(str(tmp_path / "p.db")) + read_journal(str(tmp_path / "d.db"))).rooms
        sides = {r.role: r for r in rooms if r.room == max(r.room for r in rooms)}
        whole_pages = len(whole) // PAGE_SIZE
        assert sides["decode"].pages == {"pages": whole_pages, "cached_pages": whole_pages, "received": 0,
                                         "prefill_cached_tokens": sides["prefill"].pages["cached_tokens"]}
        assert sides["prefill"].pages["sent"] == 0 and sides["prefill"].pages["decode_cached_pages"] == whole_pages
    finally:
        d.close()
        p.close()
        colocated.close()
