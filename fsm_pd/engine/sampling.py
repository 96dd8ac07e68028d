"""Choosing the next token from logits, for a batch whose rows each have their own sampling parameters.

Randomness is a function of ``(seed, step)`` only: row ``b`` draws with ``fold_in(PRNGKey(seed_b), step_b)``, where
``step_b`` counts the tokens that request has generated. So a request's output does not depend on which other
requests share its batch, on the batch bucket, or on which node (prefill or decode) samples a given step.
"""

from __future__ import annotations

import secrets
from collections.abc import Sequence
from dataclasses import dataclass, field

import jax
import jax.numpy as jnp
import numpy as np

from fsm_pd.engine import buckets


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
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if isinstance(self.stop, str):  # a lone string is one stop string, not a tuple of characters
            object.__setattr__(self, "stop", (self.stop,))
        if any(not s for s in self.stop):
            raise ValueError("stop strings must be non-empty")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def resolved_seed(self) -> int:
        """The seed to record with the request; drawn once, so every later step and node uses the same one."""
        return self.seed if self.seed is not None else secrets.randbits(31)


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
    logits = logits[:n] if logits.shape[0] != b else logits
    if logits.shape[0] != b:
        logits = jnp.pad(logits, ((0, b - n), (0, 0)))
    tokens = sample_tokens(
        logits,
        buckets.pad_1d([p.temperature for p in params], b, dtype=np.float32),
        buckets.pad_1d([p.top_p for p in params], b, fill=1, dtype=np.float32),
        buckets.pad_1d([p.top_k for p in params], b, dtype=np.int32),
        buckets.pad_1d([s & 0xFFFFFFFF for s in seeds], b, dtype=np.uint32),
        buckets.pad_1d(steps, b, dtype=np.int32),
    )
    return np.asarray(tokens)[:n]
