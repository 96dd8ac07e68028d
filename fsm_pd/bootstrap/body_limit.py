"""An ASGI middleware that refuses request bodies over a size limit with 413, before any handler sees them.

Starlette reads a body into memory whole and has no limit of its own, and uvicorn limits only the headers. The
bootstrap server's bodies are small JSON objects, so the whole body is buffered here up to the limit (whether the
client sent ``Content-Length`` or chunked it) and then replayed to the app; anything longer is cut off at the limit.
"""

from __future__ import annotations

from typing import Any

Scope = dict[str, Any]
Message = dict[str, Any]


class BodySizeLimit:
    def __init__(self, app: Any, max_bytes: int):
        if max_bytes < 1:
            raise ValueError(f"max_bytes must be positive, got {max_bytes}")
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = _content_length(scope)
        if declared is not None and declared > self.max_bytes:
            await self._refuse(send, declared)
            return
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return  # the client went away mid-body: nobody to answer
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_bytes:
                await self._refuse(send, size)
                return
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        body = b"".join(chunks)
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()  # after the body: wait for the disconnect like the real stream would

        await self.app(scope, replay, send)

    async def _refuse(self, send: Any, size: int) -> None:
        text = f"request body too large: {size} bytes, the limit is {self.max_bytes}".encode()
        await send({"type": "http.response.start", "status": 413,
                    "headers": [(b"content-type", b"text/plain; charset=utf-8"),
                                (b"content-length", str(len(text)).encode()), (b"connection", b"close")]})
        await send({"type": "http.response.body", "body": text})


def _content_length(scope: Scope) -> int | None:
    for name, value in scope.get("headers", ()):
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None  # uvicorn rejects a malformed length itself; count the bytes to be sure
    return None
