"""When a request stops: EOS or a stop token, a stop string in the decoded text, its grammar complete (structured
output: ``grammar.py``), or ``max_new_tokens``.

The text returned ends before a matched stop string unless ``no_stop_trim`` (SGLang's flag) keeps it."""

from __future__ import annotations

from collections.abc import Sequence
from enum import StrEnum

from fsm_pd.model.detokenize import IncrementalText
from fsm_pd.model.grammar import new_state
from fsm_pd.model.sampling_params import SamplingParams
from fsm_pd.model.tokenizer import Tokenizer


class FinishReason(StrEnum):
    STOP = "stop"  # EOS, a stop token or a stop string (OpenAI's name for all three)
    LENGTH = "length"  # max_new_tokens reached


class StopChecker:
    """Feeds on one request's generated tokens and says when to stop and what text to return."""

    def __init__(self, tokenizer: Tokenizer, params: SamplingParams, eos_token_ids: Sequence[int] = (),
                 before: Sequence[int] = ()) -> None:
        """``before``: tokens the request generated elsewhere (a migrated stream): part of its text, searched for
        stop strings and fed to its grammar, but not of ``output_ids`` (``max_new_tokens`` counts what is left)."""
        self._tokenizer = tokenizer
        self._params = params
        self._stop_ids = set(params.stop_token_ids)
        if not params.ignore_eos:
            self._stop_ids |= set(eos_token_ids or tokenizer.eos_token_ids)
        self._longest_stop = max((len(s) for s in params.stop), default=0)
        self.before = [int(t) for t in before]
        # text before this index has been searched for stop strings already (the old node searched ``before``'s)
        self._searched = len(tokenizer.decode(self.before)) if self.before and params.stop else 0
        self._text = ""
        self._detokenizer = IncrementalText(tokenizer)
        self.output_ids: list[int] = []
        self.finish_reason: FinishReason | None = None
        self.matched_stop: int | str | None = None
        # The request's parser, fed every token here (READY's first one too), masking the sampler's next step.
        self.grammar = new_state(params.grammar, tokenizer) if params.grammar is not None else None
        for token_id in self.before if self.grammar is not None else ():
            self.grammar.advance(token_id)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def stop_ids(self) -> frozenset[int]:
        """The tokens that end the request: EOS (unless ``ignore_eos``) and its ``stop_token_ids``."""
        return frozenset(self._stop_ids)

    @property
    def text(self) -> str:
        """The generated text so far, without special tokens and cut before a matched stop string."""
        if isinstance(self.matched_stop, str):
            return self._text
        return self._detokenizer.text(self.history)

    @property
    def history(self) -> list[int]:
        """Every token the request generated: ``before``, then this node's (what penalties count)."""
        return self.before + self.output_ids if self.before else self.output_ids

    def append(self, token_id: int) -> bool:
        """Record one generated token; returns True once the request is finished (then append no more)."""
        if self.finished:
            raise RuntimeError("append after the request finished")
        token_id = int(token_id)
        self.output_ids.append(token_id)
        grammar_done = self.grammar is not None and self.grammar.advance(token_id)
        if token_id in self._stop_ids:
            self._finish(FinishReason.STOP, token_id)
        elif grammar_done:  # the grammar takes nothing more: a stop, as if EOS had come next
            self._finish(FinishReason.STOP, None)
        elif self._params.stop and self._find_stop_string():
            pass
        elif len(self.output_ids) >= self._params.max_new_tokens:
            self._finish(FinishReason.LENGTH, None)
        return self.finished

    def _find_stop_string(self) -> bool:
        # the text a few tokens at a time (``detokenize.py``): this runs on the model thread, at every token
        text = self._detokenizer.text(self.history)
        start = max(0, self._searched - self._longest_stop + 1)
        hits = [(i, s) for s in self._params.stop if (i := text.find(s, start)) >= 0]
        self._searched = len(text)
        if not hits:
            return False
        index, stop = min(hits)
        self._text = text if self._params.no_stop_trim else text[:index]
        self._finish(FinishReason.STOP, stop)
        return True

    def _finish(self, reason: FinishReason, matched: int | str | None) -> None:
        self.finish_reason = reason
        self.matched_stop = matched
