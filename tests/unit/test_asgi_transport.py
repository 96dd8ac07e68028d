"""``InProcessASGITransport`` (``--role pd``'s router to its engines): an app's answer reaches the client chunk by
chunk as the app sends it (a stream of tokens must not wait for its end), an answer closed early is a disconnect to
the app, a socket path of ``local_apps`` is served by its app and any other one through the socket, and an app that
fails before it answers is a connect error."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from fsm_pd.net.asgi_transport import InProcessASGITransport
from fsm_pd.net.unix_http import AsyncUnixTransport


def streaming_app(gate: asyncio.Event, seen: list):
    async def app(scope, receive, send):
        request = await receive()
        seen.append(request["body"])
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]})
        await send({"type": "http.response.body", "body": b"first", "more_body": True})
        await gate.wait()  # the second chunk only once the client has read the first
        await send({"type": "http.response.body", "body": b"second", "more_body": True})
        message = await receive()  # the client closed the answer: a disconnect
        seen.append(message["type"])
    return app


def test_the_answer_streams_as_sent_and_an_early_close_is_a_disconnect():
    async def main():
        gate, seen = asyncio.Event(), []
        async with httpx.AsyncClient(transport=InProcessASGITransport(streaming_app(gate, seen))) as client:
            async with client.stream("POST", "http://engine/generate", content=b"{}") as answer:
                assert answer.status_code == 200
                chunks = answer.aiter_bytes()
                assert await asyncio.wait_for(chunks.__anext__(), 5) == b"first"  # before the app went on
                gate.set()
                assert await asyncio.wait_for(chunks.__anext__(), 5) == b"second"
            await asyncio.sleep(0.05)
        assert seen == [b"{}", "http.disconnect"]

    asyncio.run(main())


def test_an_app_that_fails_before_answering_is_a_connect_error():
    async def broken(scope, receive, send):
        raise RuntimeError("no model")

    async def main():
        async with httpx.AsyncClient(transport=InProcessASGITransport(broken)) as client:
            with pytest.raises(httpx.ConnectError, match="no model"):
                await client.get("http://engine/health")

    asyncio.run(main())


def test_local_apps_serve_their_socket_paths(tmp_path):
    sock = tmp_path / "engine.sock"
    import socket

    listener = socket.socket(socket.AF_UNIX)
    listener.bind(str(sock))  # a socket file (split_socket finds it), never accepted on
    seen: list = []

    async def app(scope, receive, send):
        seen.append(scope["path"])
        await send({"type": "http.response.start", "status": 204, "headers": []})
        await send({"type": "http.response.body", "body": b""})

    async def main():
        transport = AsyncUnixTransport({str(sock): app})
        async with httpx.AsyncClient(mounts={"http+unix://": transport}) as client:
            answer = await client.get(f"http+unix://localhost{sock}/health", timeout=5)
        return answer.status_code

    try:
        assert asyncio.run(main()) == 204 and seen == ["/health"]
    finally:
        listener.close()
