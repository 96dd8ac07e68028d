"""bench/load_client.py times a streamed chat from what the client sees: TTFT at the first chunk (fsm-pd's head goes
out with the first token, also while the text is held back), TPOT over the tokens after the first up to the finish,
and an answer counts only with a finish and its usage. The server here is a scripted SSE stream (httpx's
MockTransport), so the gaps between chunks are known."""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

import httpx
import pytest

# appended, not put first: a bench module must never shadow an installed package for the rest of the run
sys.path.append(str(Path(__file__).resolve().parents[2] / "bench"))
from load_client import stream_chat  # noqa: E402

HEAD = {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}]}
USAGE = {"choices": [], "usage": {"prompt_tokens": 900, "completion_tokens": 5}}


def text(content: str, finish: str | None = None) -> dict:
    return {"choices": [{"index": 0, "delta": {"content": content} if content else {}, "finish_reason": finish}]}


def run(script: list, status: int = 200) -> dict:
    """``stream_chat`` against a server that sends ``script``: events (dicts, "[DONE]") and pauses (seconds)."""

    async def body():
        for step in script:
            if isinstance(step, float):
                await asyncio.sleep(step)
            else:
                yield f"data: {step if step == '[DONE]' else json.dumps(step)}\n\n".encode()

    def handler(request: httpx.Request) -> httpx.Response:
        assert request.url.path == "/v1/chat/completions"
        if status != 200:
            return httpx.Response(status, json={"error": {"message": "no_healthy_decode"}})
        return httpx.Response(200, headers={"x-fsm-pd-route": "pd"}, content=body())

    async def main():
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler), base_url="http://node") as http:
            return await stream_chat(http, "http://node", "long", {"stream": True})

    return asyncio.run(main())


def test_the_head_times_the_first_token_while_the_text_is_held_back():
    # the first token's text is a byte cut mid-character: nothing to show until 0.2 s later, all at once
    record = run([0.1, HEAD, 0.2, text("abcd"), 0.1, text("e", "length"), USAGE, "[DONE]"])
    assert record["ok"] and record["route"] == "pd" and record["finish_reason"] == "length"
    assert record["prompt_tokens"] == 900 and record["completion_tokens"] == 5
    assert record["ttft_s"] == pytest.approx(0.1, abs=0.05)
    assert record["tpot_s"] == pytest.approx(0.3 / 4, abs=0.02)  # 4 gaps after the first token
    assert record["e2e_s"] >= record["ttft_s"] + 4 * record["tpot_s"] - 1e-6


@pytest.mark.parametrize("script, error", [
    ([HEAD, text("ab"), {"error": {"message": "engine died"}}, "[DONE]"], "engine died"),
    ([HEAD, text("ab", "length"), "[DONE]"], "without its usage"),
    ([HEAD, text("ab"), USAGE, "[DONE]"], "without a finish"),
])
def test_a_stream_without_its_end_is_not_an_answer(script, error):
    record = run(script)
    assert not record["ok"] and error in record["error"]


def test_a_refused_request_keeps_its_status_and_reason():
    record = run([], status=503)
    assert not record["ok"] and record["status"] == 503 and "no_healthy_decode" in record["error"]


def test_each_stream_has_a_connection_of_its_own(monkeypatch):
    # A pool shared by the streams hands requests that start together the same idle connection, and all but one go
    # round again (encode/httpcore#822): up to a second each under 64 streams. So no client ever carries two
    # requests at a time, and every stream gets one.
    import load_client

    in_flight: dict[int, int] = {}
    most: dict[int, int] = {}

    def make(timeout_s: float, *_) -> httpx.AsyncClient:  # (*_: a shared client was made with the streams)
        index = len(most)
        in_flight[index] = most[index] = 0

        async def handler(request: httpx.Request) -> httpx.Response:
            in_flight[index] += 1
            most[index] = max(most[index], in_flight[index])

            async def body():
                try:
                    await asyncio.sleep(0.01)  # the streams overlap
                    for step in (HEAD, text("ab", "length"), USAGE, "[DONE]"):
                        yield f"data: {step if step == '[DONE]' else json.dumps(step)}\n\n".encode()
                finally:
                    in_flight[index] -= 1

            return httpx.Response(200, content=body())

        return httpx.AsyncClient(transport=httpx.MockTransport(handler))

    monkeypatch.setattr(load_client, "client", make)
    records, _ = load_client.closed_loop("http://node", [("short", {"stream": True})] * 12, streams=4)
    assert len(records) == 12 and all(r["ok"] for r in records)
    assert len(most) == 4 and set(most.values()) == {1}
