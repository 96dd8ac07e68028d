"""Several tokens of a request at once (a dispatch of several decode steps): one wake-up of the event loop for them,
and one write of their events, not one each; every token still its own event, in order, and an error after them
still comes after them. (That the decode loop pushes a dispatch's tokens of a request at once:
``test_decode_steps.py``.)

With 8 steps a dispatch and 16 streams, a dispatch brings 128 tokens: a wake-up, an ``asyncio.wait`` with its task
and timer, and a pass through the ASGI send path and a socket write for each was the event loop's share of a
token (about 0.2 ms of interpreter time each on a 2-core machine, under the lock the model thread needs)."""

from __future__ import annotations

import asyncio
import json

import httpx

from fsm_pd.api.runner import RequestRun
from fsm_pd.api.streaming import DONE, answer_stream, sse
from fsm_pd.model.sampling import SamplingParams
from fsm_pd.model.tokenizer import ByteTokenizer
from fsm_pd.serving.types import EngineError, GenerateRequest, RequestStream, TokenOutput

LENGTH = {"type": "length"}


class BurstEngine:
    """Pushes its script into each request's stream as the model thread's ``push_many`` does: all at once."""

    role, model_name, max_context = "colocated", "burst", 512

    def __init__(self, *bursts: list):
        self.bursts = bursts

    def submit(self, request: GenerateRequest, stream: RequestStream) -> None:
        for burst in self.bursts:
            if isinstance(burst, BaseException):
                stream.push(burst)
            else:
                stream.push_many(burst)

    def abort(self, rid, reason=None, status=499, *, room=None) -> bool:
        return False


def _body(engine) -> list[bytes]:
    """The body a streamed answer yields, write by write."""
    async def run() -> list[bytes]:
        request = GenerateRequest("r", [1, 2, 3], SamplingParams(max_new_tokens=8), seed=0, stream=True)
        run = RequestRun(engine, request, ByteTokenizer(vocab_size=272), None)
        await asyncio.sleep(0)  # the pushes land on this loop
        response = await answer_stream(run, lambda state, out: [{"id": out.token_id}])
        return [part async for part in response.body_iterator]

    return asyncio.run(run())


def _ids(part: bytes) -> list:
    return [json.loads(line[6:]).get("id", "error") for line in part.decode().split("\n\n")
            if line.startswith("data: {")]


def test_the_tokens_here_together_go_out_in_one_write_one_event_each():
    first, rest = [TokenOutput(10)], [TokenOutput(11), TokenOutput(12), TokenOutput(13, finish_reason=LENGTH)]
    parts = _body(BurstEngine(first + rest))
    assert [_ids(part) for part in parts] == [[10, 11, 12, 13], []]  # then [DONE]
    assert parts[-1] == b"data: [DONE]\n\n"


def test_an_error_after_a_burst_comes_after_its_tokens():
    parts = _body(BurstEngine([TokenOutput(10), TokenOutput(11), TokenOutput(12)], EngineError("it broke", 500)))
    assert [_ids(part) for part in parts] == [[10, 11, 12], ["error"], []]
    assert b"it broke" in parts[1]


def test_an_event_stays_one_line_whatever_characters_its_text_holds():
    """U+0085, U+2028 and U+2029 are no line breaks to SSE, but httpx's line reader (the load bench's client, the
    built-in router's relays) splits at them: an event's JSON must not hold them raw. It held the tiny model's
    random bytes decoded, and the load bench's client failed on "Unterminated string"."""
    payload = {"choices": [{"delta": {"content": "a\u0085b\u2028c\u2029d\x0be\x1cf é 東"}}]}
    lines = list(httpx.Response(200, content=sse(payload) + DONE).iter_lines())
    assert [line for line in lines if line] == [lines[0], "data: [DONE]"]
    assert json.loads(lines[0][len("data: "):]) == payload
