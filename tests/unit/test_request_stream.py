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
