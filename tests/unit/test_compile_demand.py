"""What requests ran without is compiled first: a ready node whose background compile is still on its plan (and the
node never idle) compiles the programs a request lacked at once, what a step at a time runs on before the
several-steps programs; and until then the batch runs covered, compiling nothing while serving.

On a TPU v5e a 16-stream SmolLM2 load with 8 decode steps a dispatch ran at 71 ms a token for its whole length: the
background compile was still on the 28 several-steps programs of its plan, each waiting for an idle node that never
came, and every step of the 16-row batch ran row by row on the single-row program."""

from __future__ import annotations

import asyncio
import sys
import threading

import pytest
from polling import until

from fsm_pd.model import compile_demand, compiles, sampling
from fsm_pd.model.sampling import SamplingParams
from fsm_pd.runtime import switch_interval
from fsm_pd.serving import warmup
from fsm_pd.serving.collect import generate
from fsm_pd.serving.colocated_engine import ColocatedEngine
from fsm_pd.serving.types import GenerateRequest
from fsm_pd.serving.warmup import compile_rest, warm_up

# greedy tokens of the tiny model compared across batch shapes: float32 at full precision on a TPU too
pytestmark = [pytest.mark.chip, pytest.mark.usefixtures("full_precision")]


def test_what_a_step_at_a_time_runs_on_comes_before_the_several_steps_programs():
    compile_demand.want(("test", "loop"), "decode", "loop", lambda: None, compile_demand.LOOP)
    compile_demand.want(("test", "forward"), "decode", "forward", lambda: None)
    compile_demand.want(("test", "forward"), "decode", "forward", lambda: None)  # noted once
    taken = []
    while (item := compile_demand.take()) is not None:
        taken.append(item[0])
    assert [key for key in taken if key[0] == "test"] == [("test", "forward"), ("test", "loop")]
    compile_demand.want(("test", "loop"), "decode", "loop", lambda: None, compile_demand.LOOP)  # taken, not done yet
    assert compile_demand.take() is None
    compile_demand.done(("test", "loop"))
    compile_demand.want(("test", "loop"), "decode", "loop", lambda: None, compile_demand.LOOP)
    assert compile_demand.take()[0] == ("test", "loop")


def _requests(n: int, tokens: int = 6) -> list[GenerateRequest]:
    return [GenerateRequest(f"d{i}", [(3 * i + j) % 250 + 1 for j in range(5 + i)],
                            SamplingParams(temperature=0.0, max_new_tokens=tokens, ignore_eos=True), seed=i)
            for i in range(n)]


def _serve(engine, requests) -> list[list[int]]:
    async def serve_all():
        return await asyncio.gather(*(generate(engine, r) for r in requests))

    return [[out.token_id for out in outs] for outs in asyncio.run(asyncio.wait_for(serve_all(), 120))]


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_a_busy_node_compiles_first_what_its_batches_ran_without(monkeypatch):
    """A node that is never idle (its plan's programs each wait ``IDLE_WAIT_S``, here longer than the test): a batch
    of 4 decodes covered (row by row on the single-row program), its sampler padded up to the largest bucket, its
    several-steps program missing; the background compiles them at once, the batch's own decode step before its
    several-steps program, and nothing of its plan meanwhile, in brief turns of the interpreter's lock. Then the
    batch runs several steps a dispatch."""
    monkeypatch.setattr(warmup, "IDLE_WAIT_S", 600.0)
    monkeypatch.setattr(warmup, "READY_GRACE_S", 0.0)
    monkeypatch.setattr(sampling, "_prepared", set())  # the process's other tests prepared sampler buckets too
    # a pool size no other test uses: its programs (shared per process and pool shape) start empty
    engine = ColocatedEngine("tiny", num_pages=92, page_size=16, max_running=8, max_prefill_batch=8,
                             chunked_prefill_size=64, decode_steps_per_dispatch=4)
    stop, compiled, turns = threading.Event(), [], []
    try:
        warm_up(engine, progress=False)
        programs = engine.model.programs(engine.model_thread.pool)
        loops = programs.steps
        plan = warmup.plan_for(engine)
        loop_shape = (4, loops.width_for(1), 4)  # 4 rows, each within its first page
        assert (4, 1) in plan.background_forward and loop_shape[:2] in plan.step_loops
        assert (4, 1) not in programs.shapes and not loops.shapes
        for name, target in (("forward", programs), ("loop", loops)):  # records the order they compile in
            original = target.compile
            monkeypatch.setattr(target, "compile", lambda *shape, _o=original, _n=name: (
                compiled.append((_n, shape)), turns.append(((_n, shape), sys.getswitchinterval())), _o(*shape))[2])
        compiles.install()
        default_turn = sys.getswitchinterval()
        thread = compile_rest(engine, busy=lambda: True, stop=stop)
        serving_before = compiles.counts()["serving"]
        _serve(engine, _requests(4))
        assert compiles.counts()["serving"] == serving_before, f"compiled while serving: {list(compiles.late)}"
        assert engine.loop.dispatches == 0  # a step at a time: its several-steps program was not there
        assert until(lambda: loop_shape in loops.shapes, timeout_s=120), \
            f"the batch's several-steps program: {compiled}"
        assert (4, 1) in programs.shapes and sampling.is_prepared(4)
        order = [entry for entry in compiled if entry in (("forward", (4, 1)), ("loop", loop_shape))]
        assert order == [("forward", (4, 1)), ("loop", loop_shape)], compiled
        # compiled with the interpreter's lock changing hands in brief turns, and the usual turns back after
        assert {turn for entry, turn in turns if entry in order} == {switch_interval.BRIEF_TURN_S}, turns
        assert sys.getswitchinterval() == default_turn
        # the plan's first programs (the sampler of 2 rows, the single-row several-steps programs) wait for idle
        assert not sampling.is_prepared(2) and not any(shape[0] == 1 for shape in loops.shapes), compiled
        assert thread.is_alive()
        _serve(engine, _requests(4))
        assert engine.loop.dispatches > 0
        assert compiles.counts()["serving"] == serving_before, f"compiled while serving: {list(compiles.late)}"
    finally:
        stop.set()
        engine.close()


def test_brief_turns_nest_and_give_the_interval_back():
    default = sys.getswitchinterval()
    entered, leave = threading.Event(), threading.Event()

    def beside():
        with switch_interval.brief_turns():
            entered.set()
            leave.wait(10)

    other = threading.Thread(target=beside)
    with switch_interval.brief_turns():
        assert sys.getswitchinterval() == switch_interval.BRIEF_TURN_S
        other.start()
        entered.wait(10)
    assert sys.getswitchinterval() == switch_interval.BRIEF_TURN_S  # the other thread is still inside
    leave.set()
    other.join()
    assert sys.getswitchinterval() == default
