"""``submit`` runs on the caller's thread while the scheduler steps on the model thread. Two orders of events that load
makes likely, forced here by running a scheduler step from inside ``_open_room`` (the part of ``submit`` that opens
the request's room):

- a request whose room is refused (used before) must never reach the scheduler's queues: a step that took it would
  keep it in ``rooms`` and reserve its pages for ever (seen in ``test_bad_input_gets_4xx_and_hurts_nobody``);
- a room that ends before the scheduler has taken its request must still end that request: its event waits for it.
"""

from __future__ import annotations

import dataclasses
import threading

import pytest
from test_serving_colocated import run, until
from test_serving_pd import assert_idle, model, pd, pd_request, through_pd  # noqa: F401 - fixtures

from fsm_pd.serving.collect import generate
from fsm_pd.serving.types import EngineError


def step_now(engine) -> None:
    """One scheduler step, on the model thread, while the caller waits."""
    engine.model_thread.call(lambda _owner: engine._step(), 10)


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_a_refused_room_never_reaches_the_scheduler_even_if_a_step_runs_during_its_submit(pd, model, role):  # noqa: F811
    p, d = pd
    engine = p if role == "prefill" else d
    first = pd_request(p, f"first-{role}", model.tokenizer.encode("a room used once"), max_new_tokens=3)
    run(through_pd(p, d, first))
    opening = engine._open_room

    def open_during_a_step(seq):
        step_now(engine)
        opening(seq)

    engine._open_room = open_during_a_step
    try:
        with pytest.raises(EngineError) as refused:
            run(generate(engine, dataclasses.replace(first, rid=f"again-{role}")))
        step_now(engine)
    finally:
        del engine._open_room
    assert refused.value.status == 409
    assert engine.leak_counters()["queued"] == 0
    assert_idle(p, d)


def test_a_room_that_fails_before_its_request_is_taken_still_answers_it(pd, model):  # noqa: F811
    p, d = pd
    req = pd_request(p, "fails-at-once", model.tokenizer.encode("no prefill leg"), max_new_tokens=3)
    opening = d._open_room

    def open_then_fail_and_step(seq):
        held = threading.Event()
        d.model_thread.submit(lambda _owner: held.wait(30))  # no scheduler step runs until the room has failed
        opening(seq)
        d.manager.abort(seq.key, "failed before the scheduler took it")
        assert until(lambda: bool(d.room_events)), "the failed room's event never came"
        held.set()
        step_now(d)  # sees the Failed room before its request leaves the arrivals

    d._open_room = open_then_fail_and_step
    try:
        with pytest.raises(EngineError, match="failed before the scheduler took it"):
            run(generate(d, req))
    finally:
        del d._open_room
    assert d.leak_counters()["queued"] == 0
    assert_idle(p, d)

