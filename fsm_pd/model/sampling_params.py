"""A request's sampling parameters (``SamplingParams``), checked when made, and their limits: apart from the sampler
(``sampling.py``) so that what only reads a request's parameters (the API's models, the router) does without jax."""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from fsm_pd.runtime.random_bits import random_bits

if TYPE_CHECKING:
    from fsm_pd.model.grammar import GrammarSpec

MAX_TOP_K = 2**30  # far above any vocabulary, far below int32: the sampler clips it to the vocabulary
MAX_SEED = 2**63 - 1  # a seed is an int64 everywhere it is stored; the sampler uses its low 32 bits
MAX_STOP_STRINGS = 64  # every decode step searches each one: a long list would slow the request's whole batch
MAX_TOKEN_ID = 2**31 - 1  # token ids are int32 on the device
# as SGLang and OpenAI; the model's prefill always computes this many, so one compiled variant serves all k
MAX_TOP_LOGPROBS = 20
MAX_LOGIT_BIAS = 1024  # entries; each is a column of a dense [B, V] bias built for every step of the batch


@dataclass(frozen=True, slots=True, kw_only=True)
class SamplingParams:
    temperature: float = 1.0  # 0 means greedy
    top_p: float = 1.0  # keep the smallest set of most likely tokens whose mass reaches top_p
    top_k: int = 0  # keep the k most likely tokens; 0 keeps all
    seed: int | None = None  # None: a fresh random seed per request (see resolved_seed)
    max_new_tokens: int = 128
    stop: tuple[str, ...] = field(default=())  # stop strings; the text returned ends before the first match
    stop_token_ids: tuple[int, ...] = field(default=())
    ignore_eos: bool = False
    min_p: float = 0.0  # drop tokens whose probability is below min_p times the most likely one's
    frequency_penalty: float = 0.0  # in [-2, 2]: subtracted once per earlier occurrence in the output
    presence_penalty: float = 0.0  # in [-2, 2]: subtracted once if the token occurs in the output
    repetition_penalty: float = 1.0  # in (0, 2]: a seen token's logit is divided (positive) or multiplied by it
    logit_bias: tuple[tuple[int, float], ...] = field(default=())  # (token id, added to its logit)
    no_stop_trim: bool = False  # keep the matched stop string or stop token in the returned text
    grammar: GrammarSpec | None = None  # structured output: json_schema, regex or ebnf (grammar.grammar_of)

    def __post_init__(self) -> None:
        # Every value is checked here, before the request can join a batch: a value the batched programs cannot
        # take (an int32 overflow, a NaN) would otherwise fail every request sampled with it.
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature}")
        if not (math.isfinite(self.top_p) and 0 < self.top_p <= 1):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not _is_int(self.top_k) or not 0 <= self.top_k <= MAX_TOP_K:
            raise ValueError(f"top_k must be an integer in [0, {MAX_TOP_K}] (0 keeps all), got {self.top_k!r}")
        if not _is_int(self.max_new_tokens) or self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be an integer >= 1, got {self.max_new_tokens!r}")
        if self.seed is not None and (not _is_int(self.seed) or not 0 <= self.seed <= MAX_SEED):
            raise ValueError(f"seed must be an integer in [0, {MAX_SEED}], got {self.seed!r}")
        if isinstance(self.stop, str):  # a lone string is one stop string, not a tuple of characters
            object.__setattr__(self, "stop", (self.stop,))
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError("stop strings must be non-empty")
        if len(self.stop) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings, got {len(self.stop)}")
        if any(not _is_int(t) or not 0 <= t <= MAX_TOKEN_ID for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must be integers in [0, {MAX_TOKEN_ID}]")
        if not (math.isfinite(self.min_p) and 0 <= self.min_p <= 1):
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        for name in ("frequency_penalty", "presence_penalty"):
            value = getattr(self, name)
            if not (math.isfinite(value) and -2 <= value <= 2):
                raise ValueError(f"{name} must be in [-2, 2], got {value}")
        if not (math.isfinite(self.repetition_penalty) and 0 < self.repetition_penalty <= 2):
            raise ValueError(f"repetition_penalty must be in (0, 2], got {self.repetition_penalty}")
        if isinstance(self.logit_bias, dict):
            object.__setattr__(self, "logit_bias", tuple(self.logit_bias.items()))
        if len(self.logit_bias) > MAX_LOGIT_BIAS:
            raise ValueError(f"logit_bias takes at most {MAX_LOGIT_BIAS} entries, got {len(self.logit_bias)}")
        for tid, bias in self.logit_bias:
            if not _is_int(tid) or not 0 <= tid <= MAX_TOKEN_ID or not (math.isfinite(bias) and -100 <= bias <= 100):
                raise ValueError(f"logit_bias maps token ids in [0, {MAX_TOKEN_ID}] to numbers in [-100, 100], "
                                 f"got {tid!r}: {bias!r}")

    @property
    def adjusts_logits(self) -> bool:
        """Whether the logits need this row's history or a bias before sampling."""
        return bool(self.frequency_penalty or self.presence_penalty or self.repetition_penalty != 1
                    or self.logit_bias)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def resolved_seed(self) -> int:
        """The seed to record with the request; drawn once, so every later step and node uses the same one."""
        return self.seed if self.seed is not None else random_bits(31)  # the batch: no system call (random_bits.py)


def _is_int(value) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)
