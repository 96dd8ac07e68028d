"""``FSM_PD_STACK_SAMPLES``: a serving process samples its own threads' stacks (the TPU host lets no process trace
another), counted and written as collapsed stacks that flamegraph tools read. A node started with it:
``tests/integration/test_stack_samples_node.py``."""

from __future__ import annotations

import sys
import threading
import time

import pytest

from fsm_pd.runtime.stack_samples import StackSampler, collapsed


def spin_in_a_known_place(stop: threading.Event) -> None:
    while not stop.is_set():
        sum(range(1000))


def test_each_threads_stack_is_counted_outermost_first_under_its_name(tmp_path):
    stop = threading.Event()
    worker = threading.Thread(target=spin_in_a_known_place, args=(stop,), name="busy-one")
    worker.start()
    sampler = StackSampler(tmp_path / "stacks.txt")
    try:
        for _ in range(20):
            sampler.sample()
            time.sleep(0.001)
    finally:
        stop.set()
        worker.join()
    sampler.write()
    lines = (tmp_path / "stacks.txt").read_text().splitlines()
    counts = {line.rsplit(" ", 1)[0]: int(line.rsplit(" ", 1)[1]) for line in lines}
    busy = {stack: n for stack, n in counts.items() if stack.startswith("thread (busy-one);")}
    assert sum(busy.values()) == 20  # one sample of it each time, none of the sampler's own thread
    frames = next(iter(busy)).split(";")[1:]
    assert "threading.py:_bootstrap" in frames[0] and "spin_in_a_known_place" in frames[-1]
    values = list(counts.values())
    assert values == sorted(values, reverse=True)  # most common first


def test_a_frame_names_its_file_function_and_line():
    frame = sys._getframe()
    line = frame.f_lineno
    assert collapsed("main", frame).split(";")[-1] == (
        f"unit/test_stack_samples.py:test_a_frame_names_its_file_function_and_line:{line + 1}")


def test_a_rate_of_zero_is_refused(tmp_path):
    with pytest.raises(ValueError, match="above 0"):
        StackSampler(tmp_path / "x", hz=0)
