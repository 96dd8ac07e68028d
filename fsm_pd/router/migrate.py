"""Decode migration: when the decode node of a stream dies mid-stream, the router continues the stream on a new
prefill/decode pair, and the client sees one stream with no token missing or repeated.

How the router knows where the stream stands: it sends ``X-FSM-PD-Progress: 1`` (``api.streaming``), and every
chunk the node sends then names the token ids it carries and the request's resolved seed under ``fsm_pd_progress``,
which the router strips. That works the same for ``/generate`` and the OpenAI streams, whose chunks carry text
increments only (text does not map back to token ids).

When: the connection broke, the stream ended without ``[DONE]``, or the node sent an error event with a 5xx (a drain
that had to abort the stream, an engine failure). How the stream goes on: the router sends the same body again, with
a new room and ``fsm_pd_resume`` (the ids so far and the seed). Both new nodes prefill the prompt followed by those
ids, and the new decode node starts from where the old one was (``GenerateRequest.generated_before``): those tokens
are the start of its output, so stop strings spanning the cut are found, the text held back at the cut (a partial
UTF-8 character, a possible stop-string prefix) is sent, a chat's tool-call parser has seen what came before,
penalties and structured output count the earlier tokens, and ``usage`` counts the prompt once and every completion
token. The sampling step goes on from the earlier tokens' count with the same seed, so a sampled continuation draws
as the undisturbed stream would have (its logits may differ in the last bits: one prefill over the earlier tokens
against a step each; the tests check greedy output). ``/generate``'s chunks are cumulative, so they need nothing
more; a chat stream's continuation does not repeat the role chunk. A stream that broke before any of its events
reached the client (its node died after its 200, before or within its first event: the chat's role chunk) is no
continuation: the body goes again as the client sent it, and the client gets the whole stream, its head included.

What does not migrate: streams with logprobs (the earlier tokens' logprobs and the prompt's were the failed
attempt's), and several choices or prompts in one stream (``n`` > 1, a batch).
"""

from __future__ import annotations

import json

from fsm_pd.api.streaming import PROGRESS_FIELD

RESUMABLE_CODES = (500, 502, 503)  # not 504: a deadline passed, and the request's own is all it had


def can_migrate(path: str, body: dict) -> bool:
    """A single streamed answer (one prompt, one choice) without logprobs."""
    if body.get("stream") is not True:
        return False
    if path == "/generate":
        sp = body.get("sampling_params") or {}
        if body.get("return_logprob") or not isinstance(sp, dict) or sp.get("n") not in (None, 1):
            return False
        text, ids = body.get("text"), body.get("input_ids")
        return isinstance(text, str) or (isinstance(ids, list) and all(isinstance(i, int) for i in ids))
    logprobs = body.get("logprobs")  # completions: a count (0 too asks for them); chat: a bool
    if body.get("n") not in (None, 1) or not (logprobs is None or logprobs is False):
        return False
    if path == "/v1/chat/completions":
        return True
    if path == "/v1/completions":
        prompt = body.get("prompt")
        return body.get("best_of") in (None, 1) and not body.get("echo") and (
            isinstance(prompt, str) or (isinstance(prompt, list) and all(isinstance(i, int) for i in prompt)))
    return False


class Progress:
    """What the client has of one stream, across migrations: the token ids its chunks carried, the seed, and
    whether the finish went out."""

    def __init__(self) -> None:
        self.ids: list[int] = []
        self.seed: int | None = None
        self.finished = False
        self.relayed = False  # an event went to the client (a chat's role chunk carries no ids)

    def relay(self, line: str) -> str:
        """One SSE line of the decode stream, as the client must see it (the progress field taken out)."""
        if not line.startswith("data:") or line[5:].strip() == "[DONE]":
            return line
        self.relayed = True
        try:
            chunk = json.loads(line[5:])
        except ValueError:
            return line
        if not isinstance(chunk, dict) or "error" in chunk:
            return line
        self.finished = self.finished or finishes(chunk)
        progress = chunk.pop(PROGRESS_FIELD, None)
        if not isinstance(progress, dict):
            return line
        self.ids.extend(int(i) for i in progress.get("ids") or ())
        if isinstance(progress.get("seed"), int):
            self.seed = progress["seed"]
        return "data: " + json.dumps(chunk, ensure_ascii=False, separators=(",", ":"))

    def continued(self, body: dict) -> dict:
        """The request that continues the stream on another pair: the client's own body while the client has
        nothing of it (a resumed chat stream leaves out its role chunk)."""
        if not self.relayed:
            return body
        return {**body, "fsm_pd_resume": {"output_ids": list(self.ids), "seed": self.seed}}


def node_failure(line: str) -> str | None:
    """The message of an error event by which a node failed a stream it was sending (a 5xx: a drain past its bound
    aborted it, the engine failed): the stream can go on elsewhere. None for any other line."""
    if not line.startswith("data:") or '"error"' not in line:
        return None
    try:
        error = json.loads(line[5:])["error"]
        code = error["code"]
    except (ValueError, KeyError, TypeError):
        return None
    return str(error.get("message")) if isinstance(code, int) and code in RESUMABLE_CODES else None


class FinishWatch:
    """Whether a relayed byte stream's finish went out: its last complete ``data:`` event carried a finish reason.
    A stream relayed as it came (not migrating) that then breaks off or ends without ``[DONE]`` is complete for
    the client all the same, and gets ``[DONE]`` rather than an error after its answer."""

    def __init__(self) -> None:
        self._buffer, self._last = b"", b""

    def feed(self, chunk: bytes) -> None:
        *events, self._buffer = (self._buffer + chunk).split(b"\n\n")
        for event in events:
            event = event.strip()
            if event.startswith(b"data:") and event[5:].strip() != b"[DONE]":
                self._last = event

    @property
    def finished(self) -> bool:
        try:
            chunk = json.loads(self._last[5:])
        except ValueError:
            return False
        return isinstance(chunk, dict) and "error" not in chunk and finishes(chunk)


def finishes(chunk: dict) -> bool:
    meta = chunk.get("meta_info")
    if isinstance(meta, dict) and meta.get("finish_reason"):
        return True
    choices = chunk.get("choices")
    return isinstance(choices, list) and any(isinstance(c, dict) and c.get("finish_reason") for c in choices)
