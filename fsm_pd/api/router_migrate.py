"""Decode migration for ``/generate`` streams: when the decode node dies mid-stream, the router sends prompt + the
tokens the client already has (as ``input_ids``) to a new prefill/decode pair with ``max_new_tokens`` reduced by them,
and splices the new stream onto the old one.

Why ``/generate`` only: its chunks carry the ids generated so far (``output_ids``, cumulative, as SGLang's), so the
router knows exactly which tokens the client has; an OpenAI stream carries text increments only, and text does not
map back to token ids. Why greedy output is unchanged: the new prefill recomputes the same KV for the same ids, and
the decode's next token depends only on them (sampling with a temperature draws from ``fold_in(seed, step)``, and the
step restarts at the new node, so a sampled continuation differs from an undisturbed run).

The spliced chunks: ``output_ids`` and ``text`` are the old ones followed by the new ones, and ``meta_info`` counts
``completion_tokens`` from the first token and ``prompt_tokens`` as the client's prompt. Known limits: a stop string
that spans the cut is not seen, and text the old stream held back (a partial UTF-8 character, a possible stop-string
prefix) at the cut is lost from ``text`` (never from ``output_ids``).
"""

from __future__ import annotations

import json

from fsm_pd.api.requests import GENERATE_DEFAULT_MAX_NEW_TOKENS


def can_migrate(path: str, body: dict) -> bool:
    """A streamed single-prompt ``/generate`` without logprobs (their prompt half comes from the first prefill)."""
    if path != "/generate" or body.get("stream") is not True or body.get("return_logprob"):
        return False
    sp = body.get("sampling_params") or {}
    if not isinstance(sp, dict) or sp.get("n") not in (None, 1):
        return False
    text, ids = body.get("text"), body.get("input_ids")
    return isinstance(text, str) or (isinstance(ids, list) and all(isinstance(i, int) for i in ids))


def max_new_tokens(body: dict) -> int:
    sp = body.get("sampling_params") or {}
    value = sp.get("max_new_tokens")
    return GENERATE_DEFAULT_MAX_NEW_TOKENS if value is None else int(value)


def continued_body(body: dict, prompt_ids: list[int], sent_ids: list[int]) -> dict:
    """The request that continues after ``sent_ids``: the same fields, the prompt and those tokens as ``input_ids``,
    ``max_new_tokens`` reduced by them."""
    out = {k: v for k, v in body.items() if k not in ("text", "input_ids")}
    out["input_ids"] = list(prompt_ids) + list(sent_ids)
    out["sampling_params"] = {**(body.get("sampling_params") or {}),
                              "max_new_tokens": max_new_tokens(body) - len(sent_ids)}
    return out


class Progress:
    """What the client has been sent of one ``/generate`` stream, across migrations."""

    def __init__(self) -> None:
        self.ids: list[int] = []
        self.text = ""
        self.finished = False  # a chunk with a finish reason went out
        self._base_ids: list[int] = []
        self._base_text = ""

    def cut(self) -> None:
        """The current stream broke: what was sent so far becomes the base of the next one."""
        self._base_ids, self._base_text = list(self.ids), self.text

    def splice(self, line: str) -> str:
        """One SSE line of the current decode stream, as the client must see it (the base prepended)."""
        if not line.startswith("data:") or line[5:].strip() == "[DONE]":
            return line
        try:
            chunk = json.loads(line[5:])
        except ValueError:
            return line
        if not isinstance(chunk, dict) or "error" in chunk:
            return line
        if isinstance(chunk.get("output_ids"), list):
            chunk["output_ids"] = self._base_ids + chunk["output_ids"]
            self.ids = chunk["output_ids"]
        if isinstance(chunk.get("text"), str):
            chunk["text"] = self._base_text + chunk["text"]
            self.text = chunk["text"]
        meta = chunk.get("meta_info")
        if isinstance(meta, dict):
            if self._base_ids:
                if isinstance(meta.get("completion_tokens"), int):
                    meta["completion_tokens"] += len(self._base_ids)
                if isinstance(meta.get("prompt_tokens"), int):
                    meta["prompt_tokens"] -= len(self._base_ids)
            if meta.get("finish_reason"):
                self.finished = True
        return "data: " + json.dumps(chunk, separators=(",", ":"))
