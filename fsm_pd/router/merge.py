"""The PD router's body surgery: SGLang's bootstrap fields into a request, and the prefill's prompt logprobs into
the decode's answer (whole, or in every SSE chunk).

Only the prefill node computes the prompt's logprobs, only the decode node the output's; a client that asked for
``return_logprob`` on ``/generate`` gets ``meta_info.input_token_logprobs = prefill's + decode's`` (prefill first),
as sglang-router and mini_lb merge them.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from urllib.parse import urlsplit

from fsm_pd.net.unix_sockets import is_unix
from fsm_pd.runtime.random_bits import random_bits

ROOM_BITS = 63  # SGLang's rooms are random non-negative int64s


def new_room() -> int:
    return random_bits(ROOM_BITS)  # from the process's batch: no system call a request (runtime/random_bits.py)


def bootstrap_host(url: str) -> str:
    """The host part of a worker URL, as SGLang's routers send it (IPv6 in brackets)."""
    host = urlsplit(url).hostname or ""
    return f"[{host}]" if ":" in host else host


def check_bootstrap(prefill_url: str, bootstrap: int | str | None) -> None:
    """``ValueError`` for a prefill worker whose bootstrap server the PD fields cannot name: one on a unix socket
    must be given as ``unix:PATH`` (its URL's host says nothing of it)."""
    if is_unix(prefill_url) and not is_unix(bootstrap):
        raise ValueError(f"--prefill {prefill_url}: a prefill worker on a unix socket needs its bootstrap server's "
                         f"socket too (--prefill {prefill_url} unix:BOOTSTRAP_SOCKET), not {bootstrap!r}")


def with_bootstrap(body: dict, prefill_url: str, bootstrap: int | str | None, room: int) -> dict:
    """A copy of ``body`` with the PD fields; a client's own ``bootstrap_*`` fields are overwritten. ``bootstrap``:
    the prefill's bootstrap port (None: the decode's own default), or ``unix:PATH`` for a bootstrap server on a unix
    socket, sent as ``bootstrap_host`` with ``bootstrap_port`` null (docs/operations.md, Serving over unix sockets)."""
    if is_unix(bootstrap):
        return {**body, "bootstrap_host": bootstrap, "bootstrap_port": None, "bootstrap_room": room}
    return {**body, "bootstrap_host": bootstrap_host(prefill_url), "bootstrap_port": bootstrap,
            "bootstrap_room": room}


def prefill_input_logprobs(body: bytes) -> list[list | None] | None:
    """``meta_info.input_token_logprobs`` of each answer in a prefill's response, in order: one answer (a JSON
    document, or SSE: its first chunk that has them), or a list of answers (a batch or ``n > 1``, prompt-major)."""
    text = body.decode("utf-8", errors="replace").strip()
    documents = [text]
    if text.startswith("data:"):
        documents = [line[5:].strip() for line in text.splitlines() if line.startswith("data:")]
    for doc in documents:
        if doc == "[DONE]":
            continue
        try:
            parsed = json.loads(doc)
        except ValueError:
            return None
        if isinstance(parsed, list):
            return [_input_logprobs(item) for item in parsed]
        if (logprobs := _input_logprobs(parsed)) is not None:
            return [logprobs]
    return None


def _input_logprobs(answer) -> list | None:
    logprobs = (answer.get("meta_info") or {}).get("input_token_logprobs") if isinstance(answer, dict) else None
    return list(logprobs) if isinstance(logprobs, list) else None


def merge_into(answer: dict, prefill_logprobs: list | None) -> dict:
    """Prefill's list first, then the decode's (empty from an fsm-pd decode node). A decode list that already
    covers the prompt (a decode that repeats the prefill's) is left as it is: the prompt counts once."""
    meta = answer.get("meta_info")
    if isinstance(meta, dict) and prefill_logprobs is not None:
        own = list(meta.get("input_token_logprobs") or [])
        if len(own) < len(prefill_logprobs):
            meta["input_token_logprobs"] = prefill_logprobs + own
    return answer


def merge_json(decode_body: bytes, prefill_logprobs: list[list | None] | None) -> bytes:
    """The decode's JSON answer with the prefill's logprobs merged, answer by answer (a batch's i-th with the
    prefill's i-th); unchanged if either side has none or they do not pair up."""
    if prefill_logprobs is None:
        return decode_body
    try:
        answer = json.loads(decode_body)
    except ValueError:
        return decode_body
    answers = answer if isinstance(answer, list) else [answer]
    if len(answers) != len(prefill_logprobs) or not all(isinstance(a, dict) for a in answers):
        return decode_body
    for one, logprobs in zip(answers, prefill_logprobs, strict=True):
        merge_into(one, logprobs)
    return json.dumps(answer, separators=(",", ":")).encode()


async def merge_sse(lines: AsyncIterator[str], prefill_logprobs: list[list | None] | None) -> AsyncIterator[bytes]:
    """Re-emit an SSE stream line by line, merging into every ``data: {...}`` chunk that has a ``meta_info`` (a
    stream is one answer: batches and ``n > 1`` are not streamed)."""
    prefill_logprobs = prefill_logprobs[0] if prefill_logprobs and len(prefill_logprobs) == 1 else None
    async for line in lines:
        if prefill_logprobs is not None and line.startswith("data:") and line[5:].strip() != "[DONE]":
            try:
                chunk = json.loads(line[5:])
            except ValueError:
                chunk = None
            if isinstance(chunk, dict):
                line = "data: " + json.dumps(merge_into(chunk, prefill_logprobs), separators=(",", ":"))
        yield (line + "\n").encode()
