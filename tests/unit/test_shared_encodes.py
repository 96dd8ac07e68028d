"""``--role pd`` encodes a PD request's prompt once (``api/shared_encodes.py``): the router sends the same body to both
engine apps of the process, which share one ``SharedEncodes`` (``serve_pd.engine_apps``)."""

from __future__ import annotations

import threading

from stub_engine import StubEngine

from fsm_pd.api.requests import from_chat
from fsm_pd.api.schemas import ChatCompletionBody
from fsm_pd.api.shared_encodes import SharedEncodes
from fsm_pd.cli.serve_pd import engine_apps
from fsm_pd.model.tokenizer import ByteTokenizer


class Counted:
    """A tokenizer that counts its encodes and can be held in one until released."""

    def __init__(self, hold: threading.Event | None = None) -> None:
        self.inner, self.calls, self.hold = ByteTokenizer(512), [], hold
        self.started = threading.Event()

    def encode(self, text, **options):
        self.calls.append(text)
        self.started.set()
        if self.hold is not None:
            self.hold.wait(30)
        if text == "boom":
            raise ValueError("cannot encode")
        return self.inner.encode(text, **options)


def test_the_second_leg_takes_a_copy_of_the_first_legs_ids():
    inner = Counted()
    shared = SharedEncodes(inner)
    first, second = shared.encode("hello"), shared.encode("hello")
    assert first == second == ByteTokenizer(512).encode("hello") and inner.calls == ["hello"]
    first.append(0)  # each request owns its list
    assert second == ByteTokenizer(512).encode("hello")
    assert shared.encode("hello") == second and inner.calls == ["hello", "hello"]  # taken twice: dropped


def test_different_options_are_different_encodes():
    inner = Counted()
    shared = SharedEncodes(inner)
    shared.encode("hi", add_special_tokens=False)
    shared.encode("hi", add_special_tokens=True)
    assert inner.calls == ["hi", "hi"]


def test_a_second_leg_that_comes_while_the_first_encodes_waits_for_it():
    hold = threading.Event()
    inner = Counted(hold)
    shared = SharedEncodes(inner)
    got = {}
    first = threading.Thread(target=lambda: got.setdefault("first", shared.encode("slow")))
    first.start()
    assert inner.started.wait(30)
    second = threading.Thread(target=lambda: got.setdefault("second", shared.encode("slow")))
    second.start()
    second.join(0.2)
    assert second.is_alive()  # waiting for the first, not encoding
    hold.set()
    first.join(30)
    second.join(30)
    assert got["first"] == got["second"] == ByteTokenizer(512).encode("slow") and inner.calls == ["slow"]


def test_a_failed_encode_fails_each_leg_on_its_own():
    inner = Counted()
    shared = SharedEncodes(inner)
    for _ in range(2):
        try:
            shared.encode("boom")
        except ValueError:
            pass
        else:
            raise AssertionError("an encode that fails must raise")
    assert inner.calls == ["boom", "boom"]


def test_at_most_size_texts_are_kept():
    inner = Counted()
    shared = SharedEncodes(inner, size=2)
    for text in ("a", "b", "c"):
        shared.encode(text)
    shared.encode("a")  # pushed out by "c": encoded again
    shared.encode("c")
    assert inner.calls == ["a", "b", "c", "a"]


def test_the_apps_of_role_pd_encode_a_requests_prompt_once():
    inner = Counted()
    engines = {"prefill.sock": (StubEngine(), None), "decode.sock": (StubEngine(), None)}
    apps = engine_apps(engines, inner)
    body = ChatCompletionBody(messages=[{"role": "user", "content": "What is 2+2?"}], max_tokens=4)
    plans = [from_chat(app.state.ctx.node, app.state.ctx.tokenizer, body) for app in apps.values()]
    assert plans[0].requests[0].input_ids == plans[1].requests[0].input_ids
    assert len(inner.calls) == 1, inner.calls
    for engine, _ in engines.values():
        engine.close()
