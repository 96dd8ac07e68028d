"""``--role pd`` on one pool prefills a prompt before the decode engine's PREPARE (``serving/early_prefill.py``): its
room stays in Bootstrapping while the prompt computes, the handoff waits for PREPARE, and no more prompts are taken
early than the decode engine can still reserve pages for. The engines are the ones ``serve_pd.build_engines`` makes
(the tiny model, 4-token pages, a pool of 64); each request's prefill half is submitted first, its decode half only
when the test says, as a slow decode admission would leave it."""

from __future__ import annotations

import sqlite3
import threading
import time
from dataclasses import replace

import pytest

from fsm_pd.cli.flags import role_parser
from fsm_pd.cli.serve_pd import build_engines
from fsm_pd.machines.states import KVPoll
from fsm_pd.model.loader import load_model
from fsm_pd.model.sampling import SamplingParams
from fsm_pd.serving.types import Bootstrap, GenerateRequest

PAGE = 4


class Collected:
    """A request's outputs, pushed from the engine's threads."""

    def __init__(self):
        self.items, self.done = [], threading.Event()

    def push(self, item):
        self.push_many([item])

    def push_many(self, items):
        self.items.extend(items)
        if any(isinstance(i, BaseException) or i.finish_reason is not None for i in items):
            self.done.set()


@pytest.fixture
def engines(tmp_path):
    parser, words = role_parser(["--role", "pd", "--model", "tiny", "--journal-dir", str(tmp_path / "j"),
                                 "--page-size", str(PAGE), "--decode-steps-per-dispatch", "1"])
    model = load_model("tiny")
    prefill, decode = build_engines(parser.parse_args(words), {"prefill": model, "decode": model}, str(tmp_path),
                                    (32, 32))
    yield prefill, decode
    decode.close()
    prefill.close()


def halves(prefill, room: int, prompt_tokens: int) -> tuple[GenerateRequest, GenerateRequest]:
    host, port = prefill.bootstrap_host_port
    request = GenerateRequest(f"r{room}", [3 + (room + i) % 50 for i in range(prompt_tokens)],
                              SamplingParams(temperature=0.0, max_new_tokens=3), seed=7,
                              bootstrap=Bootstrap(host, port, room))
    return replace(request, stream=False), request


def until(condition, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def test_a_prompt_is_prefilled_before_its_prepare_and_handed_over_once_it_comes(engines):
    prefill, decode = engines
    for_prefill, for_decode = halves(prefill, 101, 18)
    prefill.submit(for_prefill, Collected())
    until(lambda: 101 in prefill._in_flight)  # its first token is sampled: the prompt is done
    assert prefill.manager.poll(101) == KVPoll.Bootstrapping  # no PREPARE yet: no handoff either
    assert prefill.info()["unprepared_rooms"] == 1
    answer = Collected()
    decode.submit(for_decode, answer)
    assert answer.done.wait(30)
    assert [type(i).__name__ for i in answer.items] == ["TokenOutput"] * 3
    until(lambda: prefill.manager.poll(101) is None and decode.manager.poll(101) is None)
    assert prefill.info()["unprepared_rooms"] == 0


def test_prompts_are_taken_early_only_while_the_decode_engine_can_still_reserve_for_them(engines):
    prefill, decode = engines
    # 40-token prompts: 10 pages each of 64, the decode engine keeps (64 - 1) // 8 = 7 free. An early prompt must
    # leave free what every unprepared room needs plus those 7: the first two fit (10 + 7 + 20 <= 54 after one),
    # the third not (10 + 7 + 30 > 44).
    pairs = [halves(prefill, room, 40) for room in (201, 202, 203)]
    for for_prefill, _ in pairs:
        prefill.submit(for_prefill, Collected())
    until(lambda: len(prefill._in_flight) == 2)
    time.sleep(0.3)  # steps go on: the third stays queued
    assert sorted(prefill._in_flight) == [201, 202]
    assert prefill.info()["early_queue"] == 1
    # the third, which the pool has no room for yet, does not hold the decode engine to one step a dispatch
    assert prefill.model_thread.submit(lambda _owner: prefill._prompts_waiting()).result(30) is False
    answers = [Collected() for _ in pairs]
    for (_, for_decode), answer in zip(pairs, answers, strict=True):
        decode.submit(for_decode, answer)
    for answer in answers:
        assert answer.done.wait(30)
        assert len(answer.items) == 3 and not any(isinstance(i, BaseException) for i in answer.items)
    until(lambda: prefill.allocator.reserved_pages == 0)


def test_a_prompt_prefilled_early_is_handed_over_when_its_prepare_lands_without_another_prefill_step(engines):
    """The loop's pass after the decode engine's step lands PREPARE; the prefill engine reacts to it there
    (``SharedPool._react``), not in its next step: here it takes no step at all after the prompt is done."""
    prefill, decode = engines
    for_prefill, for_decode = halves(prefill, 301, 18)
    prefill.submit(for_prefill, Collected())
    until(lambda: 301 in prefill._in_flight)
    prefill._driver.step = lambda: False  # the shared loop's member: no more prefill steps
    answer = Collected()
    decode.submit(for_decode, answer)
    assert answer.done.wait(30)
    assert [type(i).__name__ for i in answer.items] == ["TokenOutput"] * 3


def test_a_first_token_goes_out_only_once_its_rooms_success_is_committed(engines, tmp_path):
    """The decode engine streams a handoff's first token in the same step of the loop (``DecodeEngine.react``), before
    the step's end commits: it commits first, so no token leaves for a room the journal does not hold at Success."""
    prefill, decode = engines
    journal = tmp_path / "j" / "decode-0.db"

    class Checked(Collected):
        def push_many(self, items):
            if not self.items:  # the first token: its room's Success is in the file already
                with sqlite3.connect(journal) as conn:
                    self.success_rows = conn.execute("SELECT count(*) FROM transitions WHERE room = 401 AND "
                                                     "dst = 'Success'").fetchone()[0]
            super().push_many(items)

    for_prefill, for_decode = halves(prefill, 401, 18)
    prefill.submit(for_prefill, Collected())
    until(lambda: 401 in prefill._in_flight)
    answer = Checked()
    decode.submit(for_decode, answer)
    assert answer.done.wait(30)
    assert answer.success_rows == 1
