"""Request bodies over a size limit are refused with 413 before any handler sees them, and before any is parsed.

Starlette reads a body into memory whole and has no limit of its own, and uvicorn limits only the headers; a body of
20 MB parsed and tokenized on a node's event loop froze its streams for half a minute and got both nodes of a cluster
ejected by their router. So every server sits behind ``BodySizeLimit``: a body that declares a larger
``Content-Length`` is refused at once, and one sent chunked is counted as it comes and refused when it passes the
limit; a body within it is buffered and replayed to the app.

The limits: a node's follows its context (``request_bytes_for``: room for a prompt that fills the context, however
its text is escaped, and for the other fields), the router's is the smallest its workers report (their ``/health``),
the bootstrap server's is fixed and small. ``--max-request-bytes`` sets a node's or the router's outright.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from http import HTTPStatus
from typing import Any

Scope = dict[str, Any]
Message = dict[str, Any]

REQUEST_BYTES_BASE = 1 << 20  # the fields besides the prompt: sampling parameters, tools, a grammar, a logit bias
# a prompt's bytes per token of context: as token ids 5 to 7 ("12345, "), as text 4 on average but up to ~12 for text
# JSON-escaped by the client (\uXXXX per character) and more for long whitespace or punctuation tokens
REQUEST_BYTES_PER_TOKEN = 64
ROUTER_FALLBACK_BYTES = 8 << 20  # a router's limit until a worker reported its own (a 112k-token context's)


def request_bytes_for(max_context: int) -> int:
    """The default request body limit of a node whose context is ``max_context`` tokens (SmolLM2's 8176: 1.5 MiB).
    A batch of many long prompts in one ``/generate`` needs more: ``--max-request-bytes``."""
    return REQUEST_BYTES_BASE + REQUEST_BYTES_PER_TOKEN * max(0, int(max_context))


def byte_count(text: str) -> int:
    """An argparse type for ``--max-request-bytes``: a positive number of bytes."""
    import argparse

    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number of bytes, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1 byte, got {value}")
    return value


class BodySizeLimit:
    """``max_bytes``: the limit, or a function that says it now (a router's follows its workers). ``flag``: what
    sets it, named in the refusal."""

    def __init__(self, app: Any, max_bytes: int | Callable[[], int], flag: str = "--max-request-bytes"):
        if not callable(max_bytes) and max_bytes < 1:
            raise ValueError(f"max_bytes must be positive, got {max_bytes}")
        self.app = app
        self.limit = max_bytes if callable(max_bytes) else (lambda: max_bytes)
        self.flag = flag

    @property
    def max_bytes(self) -> int:
        return self.limit()

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        limit = self.limit()
        declared = _content_length(scope)
        if declared is not None and declared > limit:
            await self._refuse(send, declared, limit)
            return
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return  # the client went away mid-body: nobody to answer
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                await self._refuse(send, size, limit, more=True)
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

    async def _refuse(self, send: Any, size: int, limit: int, more: bool = False) -> None:
        status = HTTPStatus.REQUEST_ENTITY_TOO_LARGE
        said = f"more than {limit} bytes" if more else f"{size} bytes"
        message = f"request body too large: {said}, the limit is {limit} ({self.flag})"
        kind = status.phrase.replace(" ", "") + "Error"
        text = json.dumps({"error": {"message": message, "type": kind, "code": int(status)}}).encode()
        await send({"type": "http.response.start", "status": int(status),
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(text)).encode()),
                                (b"connection", b"close")]})
        await send({"type": "http.response.body", "body": text})


def _content_length(scope: Scope) -> int | None:
    for name, value in scope.get("headers", ()):
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None  # uvicorn rejects a malformed length itself; count the bytes to be sure
    return None
