"""Choosing the next token from logits, for a batch whose rows each have their own sampling parameters.

Randomness is a function of ``(seed, step)`` only: row ``b`` draws with ``fold_in(PRNGKey(seed_b), step_b)``, where
``step_b`` counts the tokens that request has generated. So a request's output does not depend on which other
requests share its batch, on the batch bucket, or on which node (prefill or decode) samples a given step.
"""

from __future__ import annotations

import math
import numbers
import secrets
from collections.abc import Sequence
from dataclasses import dataclass, field

import jax
import jax.numpy as jnp
import numpy as np

from fsm_pd.engine import buckets

MAX_TOP_K = 2**30  # far above any vocabulary, far below int32: the sampler clips it to the vocabulary
MAX_SEED = 2**63 - 1  # a seed is an int64 everywhere it is stored; the sampler uses its low 32 bits
MAX_STOP_STRINGS = 64  # every decode step searches each one: a long list would slow the request's whole batch
MAX_TOKEN_ID = 2**31 - 1  # token ids are int32 on the device


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

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def resolved_seed(self) -> int:
        """The seed to record with the request; drawn once, so every later step and node uses the same one."""
        return self.seed if self.seed is not None else secrets.randbits(31)


def _is_int(value) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _sample_row(logits, temperature, top_p, top_k, seed, step):
    # logits: [V] float32
    vocab = logits.shape[0]
    key = jax.random.fold_in(jax.random.PRNGKey(seed), step)
    order = jnp.argsort(-logits, stable=True)  # most likely first; ties keep the lower id first, like argmax
    ranked = logits[order] / jnp.maximum(temperature, 1e-6)
    ranks = jnp.arange(vocab)
    in_top_k = (top_k <= 0) | (ranks < top_k)
    ranked = jnp.where(in_top_k, ranked, -jnp.inf)
    probs = jax.nn.softmax(ranked)
    # A token survives top-p if the tokens ranked above it hold less than top_p: the most likely always survives.
    mass_before = jnp.cumsum(probs) - probs
    ranked = jnp.where(mass_before < top_p, ranked, -jnp.inf)
    sampled = order[jax.random.categorical(key, ranked)]
    return jnp.where(temperature <= 0, order[0], sampled).astype(jnp.int32)


@jax.jit
def sample_tokens(logits, temperature, top_p, top_k, seeds, steps):
    """Next token per row: ``logits: [B, V]``; the rest ``[B]`` (float, float, int, uint32, int). Returns ``[B]``."""
    return jax.vmap(_sample_row)(logits.astype(jnp.float32), temperature, top_p, top_k, seeds, steps)


def sample(logits, params: Sequence[SamplingParams], seeds: Sequence[int], steps: Sequence[int]) -> np.ndarray:
    """Sample one token for each of the first ``len(params)`` rows of ``logits: [>=B, V]``; returns ``[B]`` int32.

    ``seeds[b]`` is the request's resolved seed, ``steps[b]`` how many tokens it has generated before this one.
    Rows are padded to the batch bucket so the sampling program compiles once per bucket.
    """
    n = len(params)
    if len(seeds) != n or len(steps) != n or logits.shape[0] < n:
        raise ValueError(f"{n} sampling params for {len(seeds)} seeds, {len(steps)} steps, {logits.shape[0]} rows")
    b = buckets.batch_bucket(n)
    vocab = logits.shape[-1]
    logits = logits[:n] if logits.shape[0] != b else logits
    if logits.shape[0] != b:
        logits = jnp.pad(logits, ((0, b - n), (0, 0)))
    tokens = sample_tokens(
        logits,
        buckets.pad_1d([p.temperature for p in params], b, dtype=np.float32),
        buckets.pad_1d([p.top_p for p in params], b, fill=1, dtype=np.float32),
        buckets.pad_1d([min(p.top_k, vocab) for p in params], b, dtype=np.int32),
        buckets.pad_1d([s & 0xFFFFFFFF for s in seeds], b, dtype=np.uint32),
        buckets.pad_1d(steps, b, dtype=np.int32),
    )
    return np.asarray(tokens)[:n]
