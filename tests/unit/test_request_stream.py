"""``RequestStream.push`` from the model thread: after the reader's event loop closed (its server stopped while a
request was still generating), an output has nobody to go to and must not raise in the pushing thread."""

from __future__ import annotations

import asyncio

import pytest

from fsm_pd.serving.types import EngineError, RequestStream, TokenOutput


def test_a_push_after_the_readers_loop_closed_is_dropped():
    loop = asyncio.new_event_loop()
    stream = RequestStream("r", loop)
    loop.close()
    stream.push(TokenOutput(1))  # raised RuntimeError("Event loop is closed") in the engine's thread
    stream.push(EngineError("aborted", 499))


def test_a_push_to_a_live_loop_still_arrives():
    async def read() -> list[int]:
        stream = RequestStream("r")
        stream.push(TokenOutput(7, finish_reason={"type": "length"}))
        return [out.token_id async for out in stream]

    assert asyncio.run(read()) == [7]


def test_other_errors_still_raise():
    class Broken(asyncio.AbstractEventLoop):
        def call_soon_threadsafe(self, *args):
            raise RuntimeError("something else")

        def is_closed(self) -> bool:
            return False

    with pytest.raises(RuntimeError, match="something else"):
        RequestStream("r", Broken()).push(TokenOutput(1))


def test_a_waiting_reader_gets_pushes_from_another_thread_in_order_and_a_cancelled_wait_loses_nothing():
    """The reader waits on a future the next push resolves (``arrival``), not a task: a wait cut short (a deadline,
    a client gone) leaves what comes later queued, and an error pushed after outputs comes after them."""
    import threading

    async def read() -> tuple[list[int], str]:
        stream = RequestStream("r")
        waiting = stream.arrival()
        waiting.cancel()  # a wait cut short before anything came
        threading.Thread(target=lambda: (stream.push(TokenOutput(1)), stream.push_many([TokenOutput(2),
                                                                                       TokenOutput(3)]),
                                         stream.push(EngineError("aborted", 499)))).start()
        got = []
        try:
            async for out in stream:
                got.append(out.token_id)
        except EngineError as err:
            return got, str(err)
        return got, "no error"

    assert asyncio.run(read()) == ([1, 2, 3], "aborted")


def test_an_arrival_is_done_at_once_when_an_output_is_already_here():
    async def ready() -> bool:
        stream = RequestStream("r")
        stream.push(TokenOutput(5))
        await asyncio.sleep(0)  # the push lands on this loop
        return stream.arrival().done() and stream.take_ready().token_id == 5 and stream.take_ready() is None

    assert asyncio.run(ready())
