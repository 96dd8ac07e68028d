"""What a request has produced so far: token ids, logprobs, the finish reason, and its text.

Streaming sends text before the request ends, so two things are held back until they are certain: a trailing
partial UTF-8 character (it decodes to U+FFFD and becomes a real character with the next token), and a tail that
could be the start of a stop string (the engine cuts a matched stop string out of the final text, and a client
must never have been shown it).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from fsm_pd.model.detokenize import IncrementalText
from fsm_pd.serving.types import GenerateRequest, TokenOutput


def _stop_prefix_len(text: str, stops: tuple[str, ...]) -> int:
    """Length of the longest tail of ``text`` that is a proper prefix of a stop string."""
    longest = 0
    for stop in stops:
        for n in range(min(len(stop) - 1, len(text)), longest, -1):
            if text.endswith(stop[:n]):
                longest = n
                break
    return longest


@dataclass(slots=True)
class RequestState:
    request: GenerateRequest
    tokenizer: object
    started: float = field(default_factory=time.monotonic)
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[float | None] = field(default_factory=list)
    input_logprobs: list[float | None] | None = None
    top_logprobs: list[list | None] = field(default_factory=list)  # per output token: [(logprob, id), ...]
    input_top_logprobs: list | None = None  # per prompt position, None at the first
    finish_reason: dict | None = None
    final_text: str | None = None
    meta: dict = field(default_factory=dict)
    sent_text: str = ""  # what the client was shown of the text (incremental streaming)
    logprobs_sent: int = 0  # how many output tokens' logprobs the client was sent (incremental streaming)
    hide_output: bool = False  # max tokens 0: the engine's one token is not the client's
    # the text decoded a few tokens at a time: every streamed token asks for it (``detokenize.py``)
    detokenizer: IncrementalText | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        before = self.request.generated_before
        if before:  # a migrated stream: its client has the text of these tokens, all that was certain
            self.output_ids = list(before)
            self.logprobs = [None] * len(before)
            self.top_logprobs = [None] * len(before)
            self.logprobs_sent = len(before)
            self.sent_text = self.certain_text()

    def add(self, out: TokenOutput) -> None:
        if out.input_token_logprobs is not None:
            self.input_logprobs = list(out.input_token_logprobs)
        if out.input_top_logprobs is not None:
            self.input_top_logprobs = list(out.input_top_logprobs)
        self.meta.update(out.meta or {})
        if self.hide_output:
            if out.finish_reason is not None:
                self.finish_reason, self.final_text = {"type": "length", "length": 0}, ""
                self.meta["completion_tokens"] = 0
            return
        self.output_ids.append(int(out.token_id))
        self.logprobs.append(out.logprob)
        self.top_logprobs.append(out.top_logprobs)
        if out.finish_reason is not None:
            self.finish_reason = dict(out.finish_reason)
            self.final_text = out.text

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def prompt_tokens(self) -> int:
        return int(self.meta.get("prompt_tokens", len(self.request.input_ids)))

    @property
    def completion_tokens(self) -> int:
        return len(self.output_ids)

    @property
    def cached_tokens(self) -> int:
        """Prompt tokens whose KV came from the prefix cache (on the node that prefilled them)."""
        return int(self.meta.get("cached_tokens", 0))

    def _text_ids(self) -> list[int]:
        # A matched stop token id ends the output but is not part of its text (SGLang trims it too).
        matched = (self.finish_reason or {}).get("matched")
        if self.request.sampling.no_stop_trim:
            return self.output_ids
        if self.output_ids and isinstance(matched, int) and not isinstance(matched, bool) \
                and self.output_ids[-1] == matched:
            return self.output_ids[:-1]
        return self.output_ids

    def text(self) -> str:
        """The whole text so far; once finished, the engine's own (stop strings cut) when it gave one."""
        if self.finished and self.final_text is not None:
            return self.final_text
        if self.detokenizer is None:
            self.detokenizer = IncrementalText(self.tokenizer)
        return self.detokenizer.text(self._text_ids())

    def certain_text(self) -> str:
        """The text that cannot change any more: all of it once finished, else without the held-back tail."""
        text = self.text()
        if self.finished:
            return text
        text = text.rstrip("\ufffd")
        if self.request.sampling.no_stop_trim:  # a stop string will be shown anyway: nothing to hold back
            return text
        cut = _stop_prefix_len(text, self.request.sampling.stop)
        return text[: len(text) - cut] if cut else text

    def take_delta(self) -> str:
        """New certain text since the last call (for OpenAI's incremental ``delta``s)."""
        text = self.certain_text()
        if not text.startswith(self.sent_text):  # cannot happen with the hold-back; never resend what was sent
            return ""
        delta, self.sent_text = text[len(self.sent_text):], text
        return delta

    def take_logprob_start(self) -> int:
        """Index of the first output token whose logprob was not streamed yet; marks all up to now as sent."""
        start, self.logprobs_sent = self.logprobs_sent, len(self.output_ids)
        return start

    def _text(self, tid: int) -> str | None:
        return self.tokenizer.decode([tid], skip_special_tokens=False) if self.request.text_in_logprobs else None

    def input_token_logprobs(self) -> list[list]:
        """SGLang's ``[[logprob, token_id, text or None], ...]`` over the prompt from ``logprob_start_len``; the
        first prompt token has no logprob."""
        values = self.input_logprobs or []
        ids = self.request.input_ids
        if len(values) == len(ids) - 1:
            values = [None, *values]
        start = self.request.logprob_start_len
        return [[lp, tid, self._text(tid)] for lp, tid in zip(values[start:], ids[start:], strict=False)]

    def output_token_logprobs(self) -> list[list]:
        return [[lp, tid, self._text(tid)] for lp, tid in zip(self.logprobs, self.output_ids, strict=True)]

    def _top_rows(self, rows) -> list:
        return [None if row is None else [[lp, tid, self._text(tid)] for lp, tid in row] for row in rows]

    def input_top_rows(self) -> list:
        """SGLang's ``input_top_logprobs``: per prompt position from ``logprob_start_len``, ``[[logprob, id,
        text or None], ...]`` best first, or None (the first prompt token)."""
        return self._top_rows((self.input_top_logprobs or [])[self.request.logprob_start_len:])

    def output_top_rows(self) -> list:
        return self._top_rows(self.top_logprobs)

    def sglang_meta(self, prompt_logprobs: bool = True) -> dict:
        meta = {k: v for k, v in self.meta.items() if k not in ("prompt_tokens", "completion_tokens")}
        meta.update({
            "id": self.request.rid,
            "finish_reason": self.finish_reason,
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "cached_tokens": self.cached_tokens,
            "e2e_latency": round(time.monotonic() - self.started, 6),
        })
        if self.request.return_logprob:
            meta["input_token_logprobs"] = self.input_token_logprobs() if prompt_logprobs else []
            meta["output_token_logprobs"] = self.output_token_logprobs()
            if self.request.top_logprobs_num:
                # no router merges these, so a decode node gives its copy (from READY) whatever prompt_logprobs says
                meta["input_top_logprobs"] = self.input_top_rows()
                meta["output_top_logprobs"] = self.output_top_rows()
        return meta

    def sglang_response(self, prompt_logprobs: bool = True) -> dict:
        """SGLang's /generate answer (cumulative ``text`` and ``output_ids`` in every streamed chunk, as SGLang's
        default streaming does). ``prompt_logprobs=False`` (a decode node's whole answer): ``input_token_logprobs`` is
        left empty, because both PD routers put the prefill's list in front of it and the prompt must count once."""
        text = self.text() if self.finished else self.certain_text()
        return {"text": text, "output_ids": list(self.output_ids), "meta_info": self.sglang_meta(prompt_logprobs)}


def openai_finish_reason(finish_reason: dict | None) -> str | None:
    """OpenAI's names: "stop" or "length"; an aborted request reports "abort", as SGLang's OpenAI API does."""
    if finish_reason is None:
        return None
    kind = finish_reason.get("type")
    return kind if kind in ("stop", "length", "abort") else "stop"
