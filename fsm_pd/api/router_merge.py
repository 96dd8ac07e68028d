"""The PD router's body surgery: SGLang's bootstrap fields into a request, and the prefill's prompt logprobs into
the decode's answer (whole, or in every SSE chunk).

Only the prefill node computes the prompt's logprobs, only the decode node the output's; a client that asked for
``return_logprob`` on ``/generate`` gets ``meta_info.input_token_logprobs = prefill's + decode's`` (prefill first),
as sglang-router and mini_lb merge them.
"""

from __future__ import annotations

import json
import secrets
from collections.abc import AsyncIterator
from urllib.parse import urlsplit

ROOM_BITS = 63  # SGLang's rooms are random non-negative int64s


def new_room() -> int:
    return secrets.randbits(ROOM_BITS)


def bootstrap_host(url: str) -> str:
    """The host part of a worker URL, as SGLang's routers send it (IPv6 in brackets)."""
    host = urlsplit(url).hostname or ""
    return f"[{host}]" if ":" in host else host


def with_bootstrap(body: dict, prefill_url: str, bootstrap_port: int | None, room: int) -> dict:
    """A copy of ``body`` with the PD fields; a client's own ``bootstrap_*`` fields are overwritten."""
    return {**body, "bootstrap_host": bootstrap_host(prefill_url), "bootstrap_port": bootstrap_port,
            "bootstrap_room": room}


def prefill_input_logprobs(body: bytes) -> list | None:
    """``meta_info.input_token_logprobs`` of a prefill answer: one JSON document, or SSE (its first data chunk)."""
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
        logprobs = (parsed.get("meta_info") or {}).get("input_token_logprobs") if isinstance(parsed, dict) else None
        if logprobs is not None:
            return list(logprobs)
    return None


def merge_into(answer: dict, prefill_logprobs: list) -> dict:
    """Prefill's list first, then the decode's (empty from an fsm-pd decode node). A decode list that already
    covers the prompt (a decode that repeats the prefill's) is left as it is: the prompt counts once."""
    meta = answer.get("meta_info")
    if isinstance(meta, dict):
        own = list(meta.get("input_token_logprobs") or [])
        if len(own) < len(prefill_logprobs):
            meta["input_token_logprobs"] = prefill_logprobs + own
    return answer


def merge_json(decode_body: bytes, prefill_logprobs: list | None) -> bytes:
    """The decode's JSON answer with the prefill's logprobs merged; unchanged if either side has none."""
    if prefill_logprobs is None:
        return decode_body
    try:
        answer = json.loads(decode_body)
    except ValueError:
        return decode_body
    if not isinstance(answer, dict) or not isinstance(answer.get("meta_info"), dict):
        return decode_body
    return json.dumps(merge_into(answer, prefill_logprobs), separators=(",", ":")).encode()


async def merge_sse(lines: AsyncIterator[str], prefill_logprobs: list | None) -> AsyncIterator[bytes]:
    """Re-emit an SSE stream line by line, merging into every ``data: {...}`` chunk that has a ``meta_info``."""
    async for line in lines:
        if prefill_logprobs is not None and line.startswith("data:") and line[5:].strip() != "[DONE]":
            try:
                chunk = json.loads(line[5:])
            except ValueError:
                chunk = None
            if isinstance(chunk, dict):
                line = "data: " + json.dumps(merge_into(chunk, prefill_logprobs), separators=(",", ":"))
        yield (line + "\n").encode()
