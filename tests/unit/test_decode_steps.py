"""Several decode steps a dispatch in the serving engines (``DecodeLoop`` with ``steps_per_dispatch`` 8, the tiny
model): the same answers as a step at a time, rows that end mid-dispatch stop on the device, every token streamed in
order, requests that need the host decode a step at a time, a request that arrives while streams run is not held
behind long dispatches, and a PD decode node answers as a colocated one."""

from __future__ import annotations

import asyncio
import contextlib
import time

import pytest
from node_sockets import node_sockets
from test_serving_pd import assert_idle, pd_request, through_pd

from fsm_pd.model.loader import load_model
from fsm_pd.model.sampling import SamplingParams
from fsm_pd.serving.collect import generate
from fsm_pd.serving.colocated_engine import ColocatedEngine
from fsm_pd.serving.decode_engine import DecodeEngine
from fsm_pd.serving.prefill_engine import PrefillEngine
from fsm_pd.serving.types import GenerateRequest, RequestStream

# the same greedy answers from two computations of the model: float32 products at full precision on a TPU too
pytestmark = pytest.mark.usefixtures("full_precision")

PAGES, PAGE_SIZE, K = 96, 4, 8  # the serving tests' pool shape: their programs are reused


@pytest.fixture(scope="module")
def model():
    return load_model("tiny")


@pytest.fixture(scope="module")
def engines(model):
    """A step at a time, and up to K steps a dispatch, on the same model and pool shape."""
    one = ColocatedEngine(model, num_pages=PAGES, page_size=PAGE_SIZE, decode_steps_per_dispatch=1)
    several = ColocatedEngine(model, num_pages=PAGES, page_size=PAGE_SIZE, decode_steps_per_dispatch=K)
    yield one, several
    one.close()
    several.close()


def request(rid, ids, seed=0, **sampling) -> GenerateRequest:
    return GenerateRequest(rid, list(ids), SamplingParams(**{"temperature": 0.0, **sampling}), seed=seed)


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 300))


def answers(engine, requests) -> list[tuple[list[int], dict, str]]:
    async def together():
        return await asyncio.gather(*(generate(engine, r) for r in requests))

    return [([o.token_id for o in outs], outs[-1].finish_reason, outs[-1].text) for outs in run(together())]


def steps_run(engine, requests) -> tuple[list, int, int]:
    """The answers, and the decode steps and dispatches the engine ran for them."""
    before = engine.loop.counters()
    out = answers(engine, requests)
    after = engine.loop.counters()
    return out, after["decode_steps"] - before["decode_steps"], after["decode_dispatches"] - before["decode_dispatches"]


def test_a_ragged_batch_answers_as_a_step_at_a_time(engines):
    """Prompts of different lengths decoded together, greedy and seeded sampling (top-k, top-p, min-p), each ending
    at its own max_new_tokens (most mid-dispatch)."""
    one, several = engines
    made = [request(f"r{i}", [3 + i, 40, 41, 42 + i, 43, 50, 51][: 2 + i], seed=i, max_new_tokens=5 + 6 * i,
                    ignore_eos=True, **({} if i % 2 else {"temperature": 0.8, "top_k": 30, "top_p": 0.95,
                                                          "min_p": 0.01}))
            for i in range(6)]
    want = answers(one, made)
    got, steps, dispatches = steps_run(several, made)
    assert got == want
    assert [len(ids) for ids, _, _ in got] == [5 + 6 * i for i in range(6)]
    assert dispatches < steps  # several steps a dispatch


def one_request(engines, **sampling):
    """A lone greedy request, a step at a time (its answer) and K steps a dispatch (its answer and the steps run)."""
    one, several = engines
    made = request("lone", [9, 30, 31, 32], **sampling)
    (want,) = answers(one, [made])
    (got,), steps, _ = steps_run(several, [made])
    return want, got, steps


def test_a_stop_token_mid_dispatch_stops_the_row_on_the_device(engines):
    one, _ = engines
    ((base, _, _),) = answers(one, [request("base", [9, 30, 31, 32], max_new_tokens=30, ignore_eos=True)])
    third = next(j for j in range(2, len(base)) if base[j] not in base[:j])  # its first occurrence
    want, got, steps = one_request(engines, max_new_tokens=30, stop_token_ids=(base[third],))
    assert got == want and got[0] == base[: third + 1] and got[1] == {"type": "stop", "matched": base[third]}
    assert steps == third  # the first token is the prefill's; no step after the stop token's


def test_max_new_tokens_mid_dispatch_stops_the_row_on_the_device(engines):
    want, got, steps = one_request(engines, max_new_tokens=4, ignore_eos=True)
    assert got == want and len(got[0]) == 4 and got[1] == {"type": "length"}
    assert steps == 3


@contextlib.contextmanager
def context_of(engines, tokens: int):
    """Both engines with a context of ``tokens`` (prompt + output), below what their pools hold."""
    was = [e.max_context for e in engines]
    for e in engines:
        e.max_context = tokens
    try:
        yield
    finally:
        for e, value in zip(engines, was, strict=True):
            e.max_context = value


def test_the_context_length_mid_dispatch_stops_the_row_on_the_device(engines):
    with context_of(engines, 10):  # a 4-token prompt: 6 tokens, the first from the prefill
        want, got, steps = one_request(engines, max_new_tokens=30, ignore_eos=True)
    assert got == want and len(got[0]) == 6 and got[1] == {"type": "length"}
    assert steps == 5


def test_a_stop_string_mid_dispatch_ends_the_answer_where_the_host_finds_it(engines):
    one, _ = engines
    ((base, _, text),) = answers(one, [request("base", [9, 30, 31, 32], max_new_tokens=24, ignore_eos=True)])
    stop = text[len(text) // 2]
    want, got, _ = one_request(engines, max_new_tokens=24, ignore_eos=True, stop=(stop,))
    assert got == want and got[1] == {"type": "stop", "matched": stop} and len(got[0]) < len(base)


def test_every_token_streams_in_order(engines):
    _, several = engines

    async def streamed():
        stream = RequestStream("s")
        several.submit(request("s", [9, 30, 31], max_new_tokens=20, ignore_eos=True), stream)
        return [out async for out in stream]

    outs = run(streamed())
    ((want, _, _),) = answers(engines[0], [request("w", [9, 30, 31], max_new_tokens=20, ignore_eos=True)])
    assert [o.token_id for o in outs] == want
    assert [o.finish_reason for o in outs[:-1]] == [None] * 19 and outs[-1].finish_reason == {"type": "length"}


class CountingLoop:
    """The reader's event loop, counting the wake-ups the model thread's pushes cost it."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop, self.wakeups = loop, 0

    def call_soon_threadsafe(self, *args):
        self.wakeups += 1
        return self.loop.call_soon_threadsafe(*args)

    def is_closed(self) -> bool:
        return self.loop.is_closed()

    def create_future(self) -> asyncio.Future:  # the reader's wait for the next push
        return self.loop.create_future()


def test_a_dispatchs_tokens_of_a_request_wake_its_reader_once(engines):
    """The tokens a dispatch brings a request are pushed together: one wake-up of the event loop for them (then
    one write, ``test_stream_bursts.py``), not one a token."""
    _, several = engines

    async def streamed() -> tuple[list, int]:
        loop = CountingLoop(asyncio.get_running_loop())
        stream = RequestStream("b", loop)
        several.submit(request("b", [9, 30, 32], max_new_tokens=20, ignore_eos=True), stream)
        return [out async for out in stream], loop.wakeups

    before = several.loop.counters()["decode_dispatches"]
    outs, wakeups = run(streamed())
    dispatches = several.loop.counters()["decode_dispatches"] - before
    assert len(outs) == 20 and dispatches < 19
    assert wakeups == 1 + dispatches  # the prefill's first token, then one a dispatch


def test_a_request_with_logprobs_decodes_a_step_at_a_time_beside_the_others(engines):
    one, several = engines
    made = [request("lp", [9, 30, 31], max_new_tokens=10, ignore_eos=True, seed=1),
            request("plain", [12, 30, 31], max_new_tokens=10, ignore_eos=True)]
    made[0] = GenerateRequest("lp", made[0].input_ids, made[0].sampling, seed=1, return_logprob=True,
                              top_logprobs_num=2)

    async def with_logprobs(engine):
        return await asyncio.gather(*(generate(engine, r) for r in made))

    want = run(with_logprobs(one))
    before = several.loop.counters()["decode_dispatches"]
    got = run(with_logprobs(several))
    assert several.loop.counters()["decode_dispatches"] == before  # the host sampled every token of this batch
    for w, g in zip(want, got, strict=True):
        assert [o.token_id for o in g] == [o.token_id for o in w]
        assert [o.logprob for o in g] == [o.logprob for o in w]
    assert all(o.logprob is not None and len(o.top_logprobs) == 2 for o in got[0])


class EmissionStamped(RequestStream):
    """Stamps when the engine pushed the first output (the reader may see it later, after another dispatch was
    decided)."""

    def __init__(self, rid: str):
        super().__init__(rid)
        self.first_pushed: float | None = None

    def push(self, item) -> None:
        self.first_pushed = self.first_pushed or time.monotonic()
        super().push(item)

    def push_many(self, items) -> None:
        self.first_pushed = self.first_pushed or time.monotonic()
        super().push_many(items)


def test_a_request_that_arrives_mid_run_is_not_held_behind_long_dispatches(model):
    """A stream decodes K steps a dispatch; a 70-token prompt joins it, prefilled in 16-token chunks between decode
    steps. From its arrival to its first token every dispatch runs one step, so its chunks never wait for K. The
    prefill budget learns a decode step's cost from those one-step dispatches only: a dispatch of K steps, shared
    out per token, is not what a step beside a chunk costs."""
    engine = ColocatedEngine(model, num_pages=PAGES, page_size=PAGE_SIZE, chunked_prefill_size=16,
                             decode_steps_per_dispatch=K)
    observed = []
    observe = engine.budget.observe_decode
    engine.budget.observe_decode = lambda seconds: (observed.append(seconds), observe(seconds))

    async def scene():
        stream = RequestStream("running")
        engine.submit(request("running", [10, 11, 12], max_new_tokens=200, ignore_eos=True), stream)
        count, joined = 0, None
        async for _ in stream:
            count += 1
            if count == 2 * K:  # decoding K steps a dispatch by now
                joined = asyncio.ensure_future(first_token(engine, request("joins", list(range(20, 90)),
                                                                           max_new_tokens=40, ignore_eos=True)))
        return *(await joined), count

    async def first_token(engine, req):
        stream = EmissionStamped(req.rid)
        engine.submit(req, stream)
        arrived = time.monotonic()
        async for _ in stream:
            pass
        return arrived, stream.first_pushed

    try:
        arrived, first, count = run(scene())
        dispatches = list(engine.loop.recent_dispatches)
    finally:
        engine.close()
    assert count == 200
    before = [steps for at, steps in dispatches if at < arrived]
    meanwhile = [steps for at, steps in dispatches if arrived < at < first]  # decided after it was submitted
    after = [steps for at, steps in dispatches if at > first]
    assert K in before and K in after  # the stream ran K steps a dispatch when nothing waited
    assert len(meanwhile) >= 3 and set(meanwhile) == {1}, meanwhile  # one step between the prompt's chunks
    single = sum(1 for _, steps in dispatches if steps == 1)
    assert 0 < len(observed) <= single < len(dispatches), (observed, dispatches)


def test_a_decode_node_dispatching_several_steps_answers_as_a_colocated_one(engines, model, tmp_path):
    """PD: the decode node runs K steps a dispatch from READY's first token on; its answers are a colocated node's
    a step at a time, and both nodes end idle."""
    one, _ = engines
    p = PrefillEngine(model, num_pages=PAGES, page_size=PAGE_SIZE, backend="fake", journal=str(tmp_path / "p.db"),
                      **node_sockets(tmp_path, "p", bootstrap=True))
    d = DecodeEngine(model, num_pages=PAGES, page_size=PAGE_SIZE, backend="fake", secret=p.secret,
                     journal=str(tmp_path / "d.db"), decode_steps_per_dispatch=K, **node_sockets(tmp_path, "d"))
    prompts = [[(3 * i + j) % 200 + 20 for j in range(1 + 9 * i)] for i in range(5)]
    try:
        want = [ids for ids, _, _ in answers(one, [request(f"c{i}", x, max_new_tokens=11 + i, ignore_eos=True)
                                                   for i, x in enumerate(prompts)])]

        async def all_through_pd():
            return await asyncio.gather(*(through_pd(p, d, pd_request(p, f"r{i}", x, max_new_tokens=11 + i,
                                                                       ignore_eos=True))
                                          for i, x in enumerate(prompts)))

        got = [[o.token_id for o in outs] for outs in run(all_through_pd())]
        assert got == want
        assert d.loop.counters()["decode_dispatches"] > 0
        assert_idle(p, d)
    finally:
        d.close()
        p.close()


def test_on_the_tpu_kernels_a_dispatch_pads_its_batch_to_the_next_power_of_four(monkeypatch):
    """The TPU kernels (interpret mode off a TPU) inside the served loop: five ragged rows run as one dispatch of the
    16-row program (the loops' batch buckets are 4x apart there: ``StepPrograms.batch_for``), and answer as a step
    at a time on the same kernels."""
    import dataclasses

    from fsm_pd.model.loader import LoadedModel
    from fsm_pd.model.params import random_params
    from fsm_pd.model.tiny import tiny_config
    from fsm_pd.model.tokenizer import ByteTokenizer

    monkeypatch.setenv("FSM_PD_ATTENTION", "interpret")
    config = dataclasses.replace(tiny_config(), num_heads=4, num_kv_heads=2, head_dim=64, hidden_size=128,
                                 num_layers=1)
    kernel_model = LoadedModel("kernels", config, random_params(config, seed=3, std=0.1),
                               ByteTokenizer(vocab_size=config.vocab_size))
    one = ColocatedEngine(kernel_model, num_pages=40, page_size=16, decode_steps_per_dispatch=1)
    several = ColocatedEngine(kernel_model, num_pages=40, page_size=16, decode_steps_per_dispatch=4)
    made = [request(f"k{i}", list(range(5 + i, 9 + 3 * i)), max_new_tokens=6 + i, ignore_eos=True) for i in range(5)]
    try:
        want = answers(one, made)
        got, steps, dispatches = steps_run(several, made)
        loops = kernel_model.programs(several.model_thread.pool).steps
    finally:
        one.close()
        several.close()
    assert loops.kernels == "interpret" and got == want and dispatches < steps
    assert {batch for batch, _, _ in loops.shapes} <= {1, 4, 16} and (16, loops.widths[0], 4) in loops.shapes
