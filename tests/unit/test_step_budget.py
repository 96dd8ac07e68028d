"""The time bound on a prefill step while streams decode (``scheduling/step_budget.py``): the rule on its own, then
through the colocated engine's scheduler, with its clock and its model executor as ports (scripted costs: nothing
here is timed)."""

from __future__ import annotations

import asyncio
import dataclasses
import random

import pytest
from node_sockets import node_sockets
from test_serving_colocated import PAGE_SIZE, PAGES, request, run
from test_serving_pd import pd_request, through_pd

from fsm_pd.model.forward_shapes import prefill_shapes
from fsm_pd.model.input_buckets import batch_bucket, token_bucket
from fsm_pd.model.loader import load_model
from fsm_pd.scheduling.page_admission import plan_chunks
from fsm_pd.scheduling.step_budget import TRUSTED_SAMPLES, WINDOW, StepBudget
from fsm_pd.serving.colocated_engine import ColocatedEngine
from fsm_pd.serving.decode_engine import DecodeEngine
from fsm_pd.serving.forward import prefill_step
from fsm_pd.serving.prefill_engine import PrefillEngine
from fsm_pd.serving.types import Bootstrap, RequestStream

# SmolLM2 on 2 CPU cores, seconds per prefill step by padded tokens (bench/step_phases.py, quiet machine)
SMOLLM2 = {16: 0.064, 32: 0.086, 64: 0.105, 128: 0.173, 256: 0.395, 512: 0.802}


def learnt(costs: dict[int, float], decode: float, budget: int = 512, **kwargs) -> StepBudget:
    """A budget that has seen each size of ``costs`` run twice (a size's first run is not counted)."""
    steps = StepBudget(budget, **kwargs)
    for tokens, seconds in costs.items():
        steps.observe_prefill(tokens, seconds + 0.15)
        steps.observe_prefill(tokens, seconds)
    steps.observe_decode(decode)
    return steps


def test_nothing_decoding_or_the_bound_off_leaves_the_token_budget():
    steps = learnt(SMOLLM2, 0.030)
    assert steps.tokens(decoding=False) == 512
    assert learnt(SMOLLM2, 0.030, chunk_steps=0).tokens(decoding=True) == 512


def test_a_step_beside_decoding_streams_costs_at_most_chunk_steps_decode_steps():
    # one stream (30 ms a step): 4 steps are 120 ms, a 64-token chunk (105 ms) fits and a 128-token one does not;
    # eight streams (72 ms): 288 ms, 128 fits (173) and 256 (395) does not
    assert learnt(SMOLLM2, 0.030).tokens(decoding=True) == 64
    assert learnt(SMOLLM2, 0.072).tokens(decoding=True) == 128
    assert learnt(SMOLLM2, 0.072, chunk_steps=8).tokens(decoding=True) == 256
    assert learnt(SMOLLM2, 0.5).tokens(decoding=True) == 512  # a slow decode step: the token budget bounds it


def test_no_cut_below_the_floor_where_halving_a_chunk_saves_little():
    # 1 decode step of 30 ms allows 30 ms, less than any chunk; but 16 -> 32 -> 64 tokens cost only 1.34x and
    # 1.22x more each: below 64 a step is bound by reading the weights, and a smaller chunk would only add steps
    steps = learnt(SMOLLM2, 0.030, chunk_steps=1)
    assert steps.floor() == 64
    assert steps.tokens(decoding=True) == 64


def test_before_it_has_costs_it_allows_the_smallest_chunk():
    assert StepBudget(512).tokens(decoding=True) == 16
    assert learnt({}, 0.030).tokens(decoding=True) == 16
    assert StepBudget(8).tokens(decoding=True) == 8  # never above the token budget


def test_unseen_sizes_between_seen_ones_are_interpolated_and_the_next_one_up_is_tried_once():
    steps = learnt({64: 0.105, 512: 0.802}, 0.030)
    assert steps.expected(128) == pytest.approx(0.105 + (0.802 - 0.105) * 64 / 448)
    assert steps.expected(32) == pytest.approx(0.105 / 2)  # below every size seen: in proportion
    assert steps.tokens(decoding=True) == 64  # 128 expected at 192 ms
    # only a 16-token step seen: the next size up is tried while twice the largest seen's cost is within 1.5 times
    # the bound (180 ms): 32 (2 x 64 ms), 64 (2 x 86), not 128 (2 x 105); 64 then fits (105 <= 120)
    steps = learnt({16: 0.064}, 0.030)
    sizes = []
    for _ in range(4):
        sizes.append(steps.tokens(decoding=True))
        steps.observe_prefill(sizes[-1], SMOLLM2[sizes[-1]])
    assert sizes == [32, 32, 64, 64]  # a size's first run is not counted: it is run again
    # eight streams (288 ms, 432 with the slack): 128 is tried (2 x 105 = 210), then 256 (2 x 173 = 346), which at
    # 395 ms does not fit: the next steps go back to 128
    steps = learnt({64: 0.105}, 0.072)
    sizes = []
    for _ in range(5):
        sizes.append(steps.tokens(decoding=True))
        steps.observe_prefill(sizes[-1], SMOLLM2[sizes[-1]])
    assert sizes == [128, 128, 256, 256, 128]


def test_a_sizes_first_run_is_not_its_cost():
    steps = StepBudget(512)
    steps.observe_decode(0.030)
    steps.observe_prefill(64, 0.320)  # a compiled program's first run: set-up included
    assert steps.expected(64) is None and steps.tokens(decoding=True) == 16
    steps.observe_prefill(64, 0.105)
    assert steps.expected(64) == pytest.approx(0.105)
    assert steps.tokens(decoding=True) == 64


def test_one_slow_step_does_not_shrink_the_chunks_but_a_lasting_load_does():
    steps = learnt(SMOLLM2, 0.030)
    steps.observe_prefill(64, 1.0)  # another process took the cores for one step
    assert steps.tokens(decoding=True) == 64
    for _ in range(WINDOW):
        steps.observe_prefill(64, 1.0)
    assert steps.tokens(decoding=True) == 32  # 64 costs 1 s now: 32 (86 ms) is what fits


def test_a_size_seen_once_slow_is_run_again_and_its_own_samples_decide_once_there_are_enough():
    """``--role pd`` on a loaded CPU: 512 tokens kept the 42.6 ms of the one step counted, under contention, while
    256 cost 6.3 ms; beside 3.4 ms decode steps (13.6 ms allowed) the rule took 256 tokens a step for good. Capped in
    proportion to 256, 512 is expected at 12.6 ms and run; if it really costs 42.6, its samples say so."""
    steps = learnt({128: 0.0030, 256: 0.0063}, 0.0034)
    for _ in range(TRUSTED_SAMPLES):  # the sizes in use: sampled again and again
        steps.observe_prefill(256, 0.0063)
    steps.observe_prefill(512, 0.050)  # its first run: not counted
    steps.observe_prefill(512, 0.0426)  # one step under contention
    assert steps.expected(512) == pytest.approx(2 * 0.0063)
    assert steps.tokens(decoding=True) == 512
    for _ in range(TRUSTED_SAMPLES - 1):  # it really is that slow
        steps.observe_prefill(512, 0.0426)
    assert steps.expected(512) == pytest.approx(0.0426)
    assert steps.tokens(decoding=True) == 256


def test_its_state_says_what_it_knows_for_server_info():
    steps = learnt({64: 0.105, 128: 0.173}, 0.030)
    steps.cut_steps = 3
    assert steps.state() == {"chunk_steps": 4.0, "decode_ms": 30.0, "prefill_ms": {"64": 105.0, "128": 173.0},
                             "prefill_samples": {"64": 1, "128": 1}, "cut_steps": 3}
    assert StepBudget(512).state()["decode_ms"] is None


@dataclasses.dataclass
class Prompt:
    prompt_len: int
    prefilled: int = 0


def test_every_budget_forms_only_shapes_the_warm_up_compiles():
    compiled = set(prefill_shapes(8, 512))  # what a colocated node's warm-up compiles for the defaults
    rng = random.Random(0)
    budgets = set()
    for decode in (0.001, 0.01, 0.03, 0.05, 0.1, 0.3, 1.0):
        for chunk_steps in (0.5, 1, 4, 16):
            budgets.add(learnt(SMOLLM2, decode, chunk_steps=chunk_steps).tokens(decoding=True))
    assert budgets == {64, 128, 256, 512}
    for budget in budgets:
        assert budget == token_bucket(budget)
        for _ in range(200):  # the steps plan_chunks forms within it, from prompts under way of every length
            prompts = [Prompt(rng.randint(1, 900), 0) for _ in range(rng.randint(1, 10))]
            for p in prompts:
                p.prefilled = rng.randint(0, p.prompt_len - 1)
            chunks = plan_chunks(prompts, max_batch=8, budget=budget)
            shape = (batch_bucket(len(chunks)), token_bucket(max(c.length for c in chunks)))
            assert shape in compiled and shape[0] * shape[1] <= max(budget, shape[1]), (budget, shape)


JOINED = [16, 32, 32, 64, 64, 64]  # the 250-token prompt's chunk steps beside a decoding stream (see below)


class ScriptedClock:
    """Each read moves time on by ``tick`` (so a decode step measures ``tick``); the executor adds its cost."""

    def __init__(self, tick: float):
        self.now, self.tick = 0.0, tick

    def __call__(self) -> float:
        self.now += self.tick
        return self.now


@pytest.fixture(scope="module")
def model():
    return load_model("tiny")


def recording_executor(loop, clock, steps: list):
    """The production prefill step, recording each step's (padded tokens, whether a stream was decoding, the stream
    ``running``'s tokens so far) into ``steps`` and advancing the scripted clock 1 ms a padded token."""

    def executor(model_, owner, chunks):
        padded = batch_bucket(len(chunks)) * token_bucket(max(c.length for c in chunks))
        running = [s for s in loop.running if s.rid == "running"]
        steps.append((padded, bool(loop.running), running[0].generated if running else 0))
        clock.now += padded / 1000
        return prefill_step(model_, owner, chunks)

    return executor


def scene(model, chunk_steps: float) -> tuple[list[tuple[int, bool, int]], int]:
    """A stream decodes; a 250-token prompt joins it. Returns each prefill step's (padded tokens, whether a stream
    was decoding, the stream's tokens so far) and the stream's token count, under scripted costs: a decode step
    30 ms, a prefill step 30 ms + 1 ms a padded token (16: 46 ms, 32: 62, 64: 94, 128: 158)."""
    clock = ScriptedClock(0.030)
    engine = ColocatedEngine(model, num_pages=PAGES, page_size=PAGE_SIZE, chunked_prefill_size=128, radix_cache=False,
                             prefill_chunk_steps=chunk_steps, clock=clock)
    steps = []

    executor = recording_executor(engine.loop, clock, steps)

    engine.prefill_executor = executor

    async def go():
        stream = RequestStream("running")
        engine.submit(request("running", list(range(10, 20)), max_new_tokens=40, ignore_eos=True), stream)
        count = 0
        async for _ in stream:
            count += 1
            if count == 1:  # decoding now: the long prompt joins
                joined = asyncio.ensure_future(collect(engine, request("long", [7] * 250, max_new_tokens=1)))
        await joined
        return count

    try:
        return steps, run(go())
    finally:
        engine.close()


async def collect(engine, req):
    stream = RequestStream(req.rid)
    engine.submit(req, stream)
    return [out async for out in stream]


def test_the_colocated_scheduler_cuts_chunks_beside_a_decoding_stream_and_decodes_between_them(model):
    steps, tokens = scene(model, chunk_steps=4)
    assert tokens == 40
    assert steps[0] == (16, False, 0)  # the stream's own prompt: nothing decoding, the token budget
    joined = steps[1:]
    # 4 decode steps allow 120 ms. The stream's own 16-token step was that size's first run, not counted: nothing
    # known, the smallest chunk (16: 46 ms, counted now); above the sizes seen the next size is tried while twice the
    # largest seen's cost is within 180 ms, twice each (its first run is not counted): 32 (62 ms), then 64 (94 ms,
    # fits), and 128 is not tried (2 x 94); 250 = 16 + 2 x 32 + 2 x 64 + 42
    assert [padded for padded, _, _ in joined] == JOINED
    assert all(decoding for _, decoding, _ in joined)
    # the running stream got a token between every two chunks
    seen = [generated for _, _, generated in joined]
    assert seen == sorted(set(seen)), seen


def test_with_the_bound_off_the_prompt_takes_token_budget_chunks(model):
    steps, tokens = scene(model, chunk_steps=0)
    assert tokens == 40
    assert [padded for padded, _, _ in steps[1:]] == [128, 128]  # 250 = 128 + 122: the stream waits 158 ms twice


def test_a_decode_node_prefills_a_request_sent_whole_in_cut_chunks_between_its_decode_steps(model, tmp_path):
    """The local path (and a failed transfer's recompute) used to prefill a prompt whole inside one step: every stream
    decoding on the node waited for all of it. Now its chunks interleave with the decode steps, cut by the node's
    step budget: a stream sent whole decodes while a 250-token prompt sent whole joins it."""
    clock = ScriptedClock(0.030)
    engine = DecodeEngine(model, num_pages=PAGES, page_size=PAGE_SIZE, backend="fake", journal=str(tmp_path / "d.db"),
                          clock=clock, **node_sockets(tmp_path, "d"))
    engine.recompute.max_tokens = engine.budget.token_budget = 128  # the scene's token budget, as above
    steps = []

    executor = recording_executor(engine.loop, clock, steps)

    engine.recompute.prefill_executor = executor

    def sent_whole(rid, ids, room, **sampling):
        return dataclasses.replace(request(rid, ids, **sampling), route={"path": "local", "reason": "test"},
                                   bootstrap=Bootstrap("", 0, room, local=True))

    async def go():
        stream = RequestStream("running")
        engine.submit(sent_whole("running", list(range(10, 20)), 1, max_new_tokens=40, ignore_eos=True), stream)
        count = 0
        async for _ in stream:
            count += 1
            if count == 1:
                joined = asyncio.ensure_future(collect(engine, sent_whole("long", [7] * 250, 2, max_new_tokens=1)))
        await joined
        return count

    try:
        assert run(go()) == 40
    finally:
        engine.close()
    assert steps[0] == (16, False, 0)
    assert [padded for padded, _, _ in steps[1:]] == JOINED  # as on a colocated node
    seen = [generated for _, _, generated in steps[1:]]
    assert seen == sorted(set(seen)), seen  # a decode step between every two chunks


def test_a_prefill_node_serving_requests_whole_cuts_its_pd_chunks_while_they_decode(model, tmp_path):
    """A node that serves both roles (--serve-local): a stream sent whole decodes on it while a PD prompt of 250
    tokens prefills there too. The PD prompt's chunks are cut as a colocated node's are; without local streams a
    prefill node keeps its token budget (the bound is off)."""
    clock = ScriptedClock(0.030)
    p = PrefillEngine(model, num_pages=PAGES, page_size=PAGE_SIZE, backend="fake", journal=str(tmp_path / "p.db"),
                      chunked_prefill_size=128, serve_local=True, clock=clock,
                      **node_sockets(tmp_path, "p", bootstrap=True))
    d = DecodeEngine(model, num_pages=PAGES, page_size=PAGE_SIZE, backend="fake", secret=p.secret,
                     journal=str(tmp_path / "d.db"), **node_sockets(tmp_path, "d"))
    p.recompute.max_tokens = 128
    steps = []

    executor = recording_executor(p.loop, clock, steps)

    p.prefill_executor = p.recompute.prefill_executor = executor
    # the PD prompt reaches the prefill queue only after the handshake with the decode node: until its first chunk
    # ran, the stream's decode steps are held (no token, the scheduler goes on), so that it is still decoding then
    decode_step = p.loop.step
    p.loop.step = lambda: decode_step() if len(steps) > 1 else True

    async def go():
        stream = RequestStream("running")
        whole = dataclasses.replace(request("running", list(range(10, 20)), max_new_tokens=40, ignore_eos=True),
                                    route={"path": "local", "reason": "test"},
                                    bootstrap=Bootstrap("", 0, 7, local=True))
        p.submit(whole, stream)
        count = 0
        async for _ in stream:
            count += 1
            if count == 1:
                joined = asyncio.ensure_future(through_pd(p, d, pd_request(p, "pd", [7] * 250, max_new_tokens=2)))
        await joined
        return count

    try:
        assert run(go()) == 40
    finally:
        d.close()
        p.close()
    assert steps[0] == (16, False, 0)
    assert [padded for padded, _, _ in steps[1:]] == JOINED
    seen = [generated for _, _, generated in steps[1:]]
    assert seen == sorted(set(seen)), seen


def test_a_prefill_node_that_serves_no_request_whole_keeps_its_token_budget(model, tmp_path):
    p = PrefillEngine(model, num_pages=PAGES, page_size=PAGE_SIZE, bootstrap_port=None, chunked_prefill_size=128,
                      **node_sockets(tmp_path, "p", bootstrap=True))
    try:
        assert not p.budget.enabled and p.budget.tokens(decoding=True) == 128
    finally:
        p.close()
