"""``StepDriver.timing``: a scheduler's steps and the gaps between them, told apart by what the step before said: a
wait behind the model thread's other jobs after a step that asked for more, idle after one that had nothing left."""

from __future__ import annotations

import time

import pytest

from fsm_pd.model.model_thread import ModelThread
from fsm_pd.serving.step_driver import StepDriver


def test_the_driver_times_its_steps_and_tells_a_wait_behind_other_jobs_from_idle():
    now = [0.0]
    thread = ModelThread(name="test-model")
    began: list[float] = []

    def advance(seconds: float) -> None:
        now[0] += seconds

    def step() -> bool:
        began.append(now[0])
        advance(0.010)  # the step's own work
        if len(began) in (1, 2):  # a gather the KV manager asked for meanwhile runs before the next step
            thread.submit(lambda _: advance(0.003))
            return True
        return False

    driver = StepDriver(thread, step, clock=lambda: now[0])
    try:
        driver.start()
        driver.kick()
        deadline = time.monotonic() + 10
        while len(began) < 3 and time.monotonic() < deadline:
            time.sleep(0.01)
        thread.call(lambda _: None)
        advance(5.0)  # nothing to do until a request comes
        driver.kick()
        thread.call(lambda _: None)
        assert began == pytest.approx([0.0, 0.013, 0.026, 5.036])
        timing = driver.timing()
        assert timing["steps"] == 4 and timing["busy_s"] == pytest.approx(0.040)
        assert timing["waits"] == 2 and timing["waited_s"] == pytest.approx(0.006)
        assert timing["waited_max_s"] == pytest.approx(0.003) and timing["idle_s"] == pytest.approx(5.0)
    finally:
        driver.close()
        thread.close()
