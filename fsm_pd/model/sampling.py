"""Choosing the next token from logits, for a batch whose rows each have their own sampling parameters.

Before sampling, a row's logits are adjusted by its own history only (SGLang's penalties, over the tokens the request
generated so far, the first one included, which a PD prefill sampled): the repetition penalty divides a seen token's
positive logit (multiplies a negative one), the frequency penalty subtracts ``count * penalty``, the presence
penalty subtracts ``penalty`` once, then ``logit_bias`` is added. A row with a grammar (structured output,
``grammar.py``) then loses every token its grammar does not allow. Then temperature, top-k, top-p and min-p.

Nothing sorts the vocabulary (``sample_row`` says how top-k and top-p stay cheap). Randomness is a function of
``(seed, step)`` only: row ``b`` draws with ``fold_in(PRNGKey(seed_b), step_b)``, where
``step_b`` counts the tokens that request has generated. So a request's output does not depend on which other
requests share its batch, on the batch bucket, or on which node (prefill or decode) samples a given step.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from fsm_pd.model import compile_demand, input_buckets
from fsm_pd.model.grammar import GrammarState, bitmask
from fsm_pd.model.sampling_params import (  # noqa: F401 - the sampler's callers import them from here too
    MAX_LOGIT_BIAS,
    MAX_SEED,
    MAX_STOP_STRINGS,
    MAX_TOKEN_ID,
    MAX_TOP_K,
    SamplingParams,
)

CANDIDATES = 256  # top-k and top-p choose among this many most likely tokens (see sample_row)


def sample_row(logits, temperature, top_p, top_k, min_p, seed, step):
    """One row's token: greedy, from the whole distribution, or from the top-k / top-p candidates.

    No row sorts the vocabulary: on CPU that sort cost 12 ms a row at SmolLM2's 49k tokens, more than a model step.
    A row without top-k and top-p draws from the whole distribution with one uniform number and the cumulative
    probabilities (exact). A row with either ranks only the ``CANDIDATES`` most likely tokens, which is exact for
    ``top_k <= CANDIDATES`` and for any nucleus that fits in them; a larger top-k, or a nucleus wider than that on a
    flat distribution, is cut at ``CANDIDATES`` tokens.
    """
    vocab = logits.shape[0]
    key_full, key_candidates = jax.random.split(jax.random.fold_in(jax.random.PRNGKey(seed), step))
    greedy = jnp.argmax(logits)  # ties: the lower id
    scaled = logits / jnp.maximum(temperature, 1e-6)
    log_norm = jax.nn.logsumexp(scaled)
    # the whole distribution, min-p applied: P(token) = its share of the kept mass
    probs = jnp.exp(scaled - log_norm)
    probs = jnp.where(probs >= min_p * probs.max(), probs, 0.0)
    cumulative = jnp.cumsum(probs)
    drawn = jax.random.uniform(key_full, dtype=cumulative.dtype) * cumulative[-1]
    whole = jnp.minimum(jnp.searchsorted(cumulative, drawn, side="right"), vocab - 1)
    # top-k, then top-p, then min-p among the candidates, most likely first (ties: the lower id first)
    values, ids = jax.lax.top_k(scaled, min(CANDIDATES, vocab))
    ranks = jnp.arange(values.shape[0])
    ranked = jnp.where((top_k <= 0) | (ranks < top_k), values, -jnp.inf)
    # top-p's mass is of the distribution top-k left: the candidates alone after top-k, else the whole vocabulary
    candidate_probs = jnp.exp(ranked - jnp.where(top_k > 0, jax.nn.logsumexp(ranked), log_norm))
    # A token survives top-p if the tokens ranked above it hold less than top_p: the most likely always survives.
    mass_before = jnp.cumsum(candidate_probs) - candidate_probs
    keep = (mass_before < top_p) & (candidate_probs >= min_p * candidate_probs[0])
    chosen = ids[jax.random.categorical(key_candidates, jnp.where(keep, ranked, -jnp.inf))]
    sampled = jnp.where((top_k > 0) | (top_p < 1), chosen, whole)
    return jnp.where(temperature <= 0, greedy, sampled).astype(jnp.int32)


# A sampled batch's per-row parameters travel as one int32 array ``[B, ROW_PARAMS]`` (floats and seeds as their
# bits), unpacked on the device: one host-to-device transfer a step instead of one per parameter (six; on a TPU host
# each costs about 0.1 ms).
TEMPERATURE, TOP_P, TOP_K, MIN_P, SEED, STEP = range(6)
ROW_PARAMS = 6


def pack_rows(params: Sequence[SamplingParams], seeds: Sequence[int], steps: Sequence[int], rows: int,
              vocab: int) -> np.ndarray:
    """``sample_tokens``' row parameters for ``params``, padded to ``rows`` (padding rows: greedy, top-p 1)."""
    out = np.zeros((rows, ROW_PARAMS), np.int32)
    out[:, TOP_P] = np.float32(1).view(np.int32)
    n = len(params)
    bits = lambda values: np.asarray(values, np.float32).view(np.int32)  # noqa: E731
    out[:n, TEMPERATURE] = bits([p.temperature for p in params])
    out[:n, TOP_P] = bits([p.top_p for p in params])
    out[:n, TOP_K] = [p.top_k if p.top_k < vocab else 0 for p in params]  # >= the vocabulary: keep all
    out[:n, MIN_P] = bits([p.min_p for p in params])
    out[:n, SEED] = np.asarray([s & 0xFFFFFFFF for s in seeds], np.uint32).view(np.int32)
    out[:n, STEP] = steps
    return out


@jax.jit
def sample_tokens(logits, rows):
    """Next token per row: ``logits: [B, V]``, ``rows: [B, ROW_PARAMS]`` (``pack_rows``). Returns ``[B]``."""
    floats = lambda column: jax.lax.bitcast_convert_type(rows[:, column], jnp.float32)  # noqa: E731
    seeds = jax.lax.bitcast_convert_type(rows[:, SEED], jnp.uint32)
    return jax.vmap(sample_row)(logits.astype(jnp.float32), floats(TEMPERATURE), floats(TOP_P), rows[:, TOP_K],
                                floats(MIN_P), seeds, rows[:, STEP])


@jax.jit
def greedy_tokens(logits):
    """``argmax`` per row (ties: the lower id): a batch where every row is greedy needs nothing else."""
    return jnp.argmax(logits, axis=-1).astype(jnp.int32)


@jax.jit
def adjust_logits(logits, counts, frequency, presence, repetition, bias):
    """SGLang's penalties and the logit bias: ``logits, counts, bias: [B, V]``; the penalties ``[B]``."""
    logits = logits.astype(jnp.float32)
    seen = counts > 0
    rep = repetition[:, None]
    logits = jnp.where(seen, jnp.where(logits > 0, logits / rep, logits * rep), logits)
    logits = logits - frequency[:, None] * counts - presence[:, None] * seen
    return logits + bias


@jax.jit
def mask_logits(logits, mask):
    """``logits: [B, V]`` with every token whose bit is clear in ``mask: [B, ceil(V / 32)]`` (int32) set to -inf."""
    ids = jnp.arange(logits.shape[-1])
    allowed = (mask[:, ids // 32] >> (ids % 32)) & 1
    return jnp.where(allowed == 1, logits.astype(jnp.float32), -jnp.inf)


def penalty_inputs(params: Sequence[SamplingParams], histories: Sequence[Sequence[int]], rows: int, vocab: int):
    """Host arrays for ``adjust_logits``: per-row token counts of the history and the dense bias, padded to
    ``rows``. Ids outside the vocabulary (a bias for a token the model has not) are ignored."""
    counts = np.zeros((rows, vocab), np.float32)
    bias = np.zeros((rows, vocab), np.float32)
    for b, (p, history) in enumerate(zip(params, histories, strict=True)):
        if not p.adjusts_logits:
            continue
        ids = np.asarray(history, dtype=np.int64)
        ids = ids[(ids >= 0) & (ids < vocab)]
        counts[b] = np.bincount(ids, minlength=vocab)[:vocab]
        for tid, value in p.logit_bias:
            if tid < vocab:
                bias[b, tid] += value
    return counts, bias


# The sampling programs a warm-up prepared ahead (``hold``), by (program, batch rows, where the logits are): compiled
# from shapes, or loaded as the executables an earlier start wrote (``executables.compiled``: on a TPU v5e, tracing
# and lowering the eight programs took 1.8 s of the interpreter on every warm start, round r17). ``sample`` calls
# them, not the jitted functions, whose own cache a loaded program does not fill. Where the logits are is part of the
# key: ``--role pd`` with a device for each role warms up a set of samplers on each device.
_held: dict[tuple[str, int, Any], jax.stages.Compiled] = {}


def hold(name: str, batch: int, placed: Any, program: jax.stages.Compiled) -> None:
    """``program`` runs ``name`` (``greedy_tokens``, ``sample_tokens``, ``adjust_logits``, ``mask_logits``) at
    ``batch`` rows on logits placed by ``placed`` (a sharding) from now on."""
    _held[(name, batch, placed)] = program


def _run(jitted, *args):
    """``jitted(*args)`` on the program held for its batch and its logits' placement, or jitted where none is. A held
    program checks its arguments before it runs anything (the samplers donate nothing): one typed otherwise than it
    was compiled for runs jitted instead, and that program is let go."""
    key = (jitted.__name__, args[0].shape[0], getattr(args[0], "sharding", None))
    program = _held.get(key)
    if program is not None:
        try:
            return program(*args)
        except (TypeError, ValueError):
            _held.pop(key, None)
    return jitted(*args)


# Batch buckets whose sampling programs have run in this process (``mark_prepared``: a serving node's warm-up). A
# batch of another bucket is padded up to the nearest larger one of them rather than compile while a request waits;
# with none marked (no warm-up ran), every bucket is its own.
_prepared: set[int] = set()


def mark_prepared(bucket: int) -> None:
    _prepared.add(bucket)


def is_prepared(bucket: int) -> bool:
    return bucket in _prepared


def prepare(batch: int, vocab: int, sharding) -> None:
    """Run every sampling program once at ``batch`` rows on zeros placed by ``sharding`` (where the forward pass
    leaves its logits: jit's cache tells a committed array from a fresh one), then mark the bucket prepared."""
    logits = jax.device_put(np.zeros((batch, vocab), np.float32), sharding)
    zeros = np.zeros(batch, np.float32)
    greedy_tokens(logits).block_until_ready()
    sample_tokens(logits, pack_rows([], [], [], batch, vocab)).block_until_ready()
    adjust_logits(logits, np.zeros((batch, vocab), np.float32), zeros, zeros, zeros + 1,
                  np.zeros((batch, vocab), np.float32)).block_until_ready()
    mask_logits(logits, np.full((batch, (vocab + 31) // 32), -1, np.int32)).block_until_ready()
    mark_prepared(batch)


def sampling_rows(n: int) -> int:
    """The rows ``sample`` runs ``n`` requests on: their batch bucket, or the nearest larger prepared one."""
    b = input_buckets.batch_bucket(n)
    if not _prepared or b in _prepared:
        return b
    return min((p for p in _prepared if p > b), default=b)


def sample(logits, params: Sequence[SamplingParams], seeds: Sequence[int], steps: Sequence[int],
           histories: Sequence[Sequence[int]] | None = None,
           grammars: Sequence[GrammarState | None] | None = None) -> np.ndarray:
    """Sample one token for each of the first ``len(params)`` rows of ``logits: [>=B, V]``; returns ``[B]`` int32.

    ``seeds[b]`` is the request's resolved seed, ``steps[b]`` how many tokens it has generated before this one,
    ``histories[b]`` those tokens (needed only by rows with penalties; None: nothing generated yet),
    ``grammars[b]`` the row's grammar state, whose mask is applied last (None: no row has one). Rows are
    padded to the batch bucket so the sampling program compiles once per bucket (``sampling_rows``).
    """
    n = len(params)
    if len(seeds) != n or len(steps) != n or logits.shape[0] < n:
        raise ValueError(f"{n} sampling params for {len(seeds)} seeds, {len(steps)} steps, {logits.shape[0]} rows")
    b = sampling_rows(n)
    vocab = logits.shape[-1]
    if b != (own := input_buckets.batch_bucket(n)):  # padded up: the background prepares the bucket next
        sharding = getattr(logits, "sharding", None)
        compile_demand.want(("sampling", own, vocab, sharding), "sampling", f"sampling {own} rows",
                            lambda: prepare(own, vocab, sharding))
    if logits.shape[0] != b:  # on the host: a slice or pad on the device is a program per shape
        rows = np.zeros((b, vocab), np.float32)
        rows[:n] = np.asarray(logits)[:n]
        logits = jax.device_put(rows, getattr(logits, "sharding", None))
    if any(p.adjusts_logits for p in params):
        counts, bias = penalty_inputs(params, histories if histories is not None else [()] * n, b, vocab)
        logits = _run(
            adjust_logits, logits, counts,
            input_buckets.pad_1d([p.frequency_penalty for p in params], b, dtype=np.float32),
            input_buckets.pad_1d([p.presence_penalty for p in params], b, dtype=np.float32),
            input_buckets.pad_1d([p.repetition_penalty for p in params], b, fill=1, dtype=np.float32),
            bias,
        )
    mask = bitmask(grammars, b, vocab) if grammars is not None else None
    if mask is not None:
        logits = _run(mask_logits, logits, mask)
    if all(p.greedy for p in params):
        return np.asarray(_run(greedy_tokens, logits))[:n]
    return np.asarray(_run(sample_tokens, logits, pack_rows(params, seeds, steps, b, vocab)))[:n]
