"""The Llama-family decoder (Llama, Qwen2, Qwen3) over the paged KV pool: prefill and decode.

The jitted core, ``forward_paged``, runs ``S`` new tokens for each of ``B`` sequences: prefill is ``S`` = the prompt
bucket, decode is ``S = 1``. The host-side wrappers below pad the batch and the prompt length to a bucket
(``input_buckets.py``) and every page table to the pool's fixed width (``table_width``), so the programs a node can ever
run are one per (batch bucket, token bucket), and check page ids before anything is written. The pool argument is
donated: after a call, only the returned pool is valid.
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from fsm_pd.kernels.layout import PAD_PAGE
from fsm_pd.kernels.pool_format import PoolJit
from fsm_pd.model import input_buckets
from fsm_pd.model.attention import Kernels, block_pages, paged_attention, reference_attention
from fsm_pd.model.config import ModelConfig
from fsm_pd.model.rope import apply_rope, inverse_frequencies
from fsm_pd.model.sampling_params import MAX_TOP_LOGPROBS

# Incremented while tracing, i.e. once per compiled program: lets tests and the server see recompiles.
TRACE_COUNTS: collections.Counter[str] = collections.Counter()


def rms_norm(x, weight, eps: float):
    x32 = x.astype(jnp.float32)
    normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return (normed * weight.astype(jnp.float32)).astype(x.dtype)


def _project_qkv(config: ModelConfig, layer: dict, h, positions, inv_freq):
    # h: [B, S, D] -> q: [B, S, H, Dh], k, v: [B, S, KVH, Dh]
    b, s, _ = h.shape
    qkv = h @ layer["wqkv"]  # [B, S, (H + 2*KVH) * Dh]
    if config.attention_bias:
        qkv = qkv + layer["bqkv"]
    q_out, kv_out = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    q, k, v = jnp.split(qkv, [q_out, q_out + kv_out], axis=-1)
    q = q.reshape(b, s, config.num_heads, config.head_dim)
    k = k.reshape(b, s, config.num_kv_heads, config.head_dim)
    v = v.reshape(b, s, config.num_kv_heads, config.head_dim)
    if config.qk_norm:
        q = rms_norm(q, layer["q_norm"], config.rms_norm_eps)
        k = rms_norm(k, layer["k_norm"], config.rms_norm_eps)
    return apply_rope(q, positions, inv_freq), apply_rope(k, positions, inv_freq), v


def _decoder_layer(config: ModelConfig, layer: dict, x, positions, inv_freq, attend: Callable,
                   reduce: Callable = lambda partial_sum: partial_sum):
    """One pre-norm block. ``attend(q, k, v) -> (out, extra)`` decides where K/V live; ``extra`` is passed back.

    ``reduce`` completes the two row-split products (attention out, MLP down): under tensor parallelism each device
    holds some heads and some of the MLP's columns, so each product is a partial sum that ``reduce`` adds up over the
    devices (``tensor_parallel.py``); on one device there is nothing to add.
    """
    b, s, _ = x.shape
    q, k, v = _project_qkv(config, layer, rms_norm(x, layer["attn_norm"], config.rms_norm_eps), positions, inv_freq)
    attn, extra = attend(q, k, v)
    x = x + reduce(attn.reshape(b, s, -1) @ layer["wo"])
    h = rms_norm(x, layer["mlp_norm"], config.rms_norm_eps)
    gate, up = jnp.split(h @ layer["w_gate_up"], 2, axis=-1)
    x = x + reduce((jax.nn.silu(gate) * up) @ layer["w_down"])
    return x, extra


def _logits(config: ModelConfig, params: dict, h):
    # h: [..., D] -> [..., V] in float32, so sampling and logprobs see full precision whatever the weights' dtype
    head = params["embed"].T if config.tie_word_embeddings else params["lm_head"]
    return (h @ head).astype(jnp.float32)


# the pool's results row-major, as it comes in (``kernels/pool_format.py``)
@partial(PoolJit, pool="pool", results=lambda pool: (None, pool, None), static_argnames=("config", "kernels"),
         donate_argnames=("pool",))
def forward_paged(params, pool, tokens, starts, lengths, page_tables, *, config: ModelConfig, kernels: Kernels = "jnp"):
    """Run ``tokens: [B, S]`` at positions ``starts[:, None] + [0, S)`` through the decoder, as one program.

    Only the first ``lengths[b]`` tokens of row ``b`` are real; the rest write to the pad page. ``page_tables: [B, W]``
    lists each row's pages in position order, padded to the node's table width (``table_width``). Returns the logits
    of each row's last real token ``[B, V]``, the updated pool, and the final hidden state of every position
    ``[B, S, D]`` (prompt logprobs are computed from it apart, so asking for them compiles no other forward pass).

    A serving node runs the same computation in pieces instead (``programs.ForwardPrograms``): ``embed_tokens``,
    then ``forward_group`` over a few layers at a time, then ``final_logits``; this whole-model program is for
    callers that compile nothing ahead (and is what the pieces are checked against).
    """
    x = embed_tokens(params["embed"], tokens)
    x, pool = forward_group(params["layers"], pool, x, starts, lengths, page_tables, config=config, kernels=kernels)
    logits, h = final_logits(top_params(params), x, lengths, config=config)
    return logits, pool, h


def top_params(params: dict) -> dict:
    """The parameters outside the layers (embeddings, final norm, LM head): what ``final_logits`` reads."""
    return {name: value for name, value in params.items() if name != "layers"}


def embed_tokens(embed, tokens):
    """``tokens: [B, S]`` -> ``[B, S, D]``."""
    return embed[tokens]


def final_logits(top: dict, x, lengths, *, config: ModelConfig):
    """From the last layer's output ``x: [B, S, D]``: the logits of each row's last real token ``[B, V]``, and the
    final hidden state of every position ``[B, S, D]``."""
    h = rms_norm(x, top["final_norm"], config.rms_norm_eps)
    last = h[jnp.arange(x.shape[0]), jnp.maximum(lengths - 1, 0)]  # [B, D]
    return _logits(config, top, last), h


def forward_group(layers: Sequence[dict], pools: tuple, x, starts, lengths, page_tables, *, config: ModelConfig,
                  reduce: Callable = lambda partial_sum: partial_sum, real_kv=None, kernels: Kernels = "jnp"):
    """Run ``x: [B, S, D]`` through ``layers`` (consecutive layers of the model, any number of them), each writing
    its new tokens' K/V into its pool in ``pools`` and attending over them; returns ``x`` after the last and the
    updated pools. Arguments as ``forward_paged``'s.

    One device, or one shard of a tensor-parallel model (``reduce``: see ``_decoder_layer``; ``config`` is then the
    shard's, with its share of the heads and of the MLP). ``real_kv: [KVH]`` bool, under tensor parallelism with
    padding heads: False marks a padding slot, whose K and V are stored as exact zeros (its weights are zero, but
    RoPE can turn a zero into -0.0, and a handoff between other splits fills padding slots with +0.0: the pool's
    bytes would differ for no reason). ``kernels``: which attention code (``attention.kernels_for``)."""
    TRACE_COUNTS["forward_group"] += 1
    s = x.shape[1]
    positions = starts[:, None] + jnp.arange(s, dtype=jnp.int32)[None, :]  # [B, S]
    inv_freq = jnp.asarray(inverse_frequencies(config))
    # Every layer has the same shapes, so one traced and lowered layer serves them all: the program calls it once
    # per layer, and XLA inlines the calls (the same program as writing the layers out, in place as before). Tracing
    # and lowering 30 copies of a layer was 1.2 s of every SmolLM2 program, on every start, cache or not.
    layer_step = jax.jit(partial(_paged_layer, config=config, reduce=reduce, kernels=kernels))
    new_pools = []
    for layer, layer_pool in zip(layers, pools, strict=True):
        x, layer_pool = layer_step(layer, layer_pool, x, positions, inv_freq, page_tables, starts, lengths, real_kv)
        new_pools.append(layer_pool)
    return x, tuple(new_pools)


def _paged_layer(layer, layer_pool, x, positions, inv_freq, page_tables, starts, lengths, real_kv, *,
                 config: ModelConfig, reduce: Callable, kernels: Kernels):
    attend = partial(paged_attention, layer_pool=layer_pool, page_tables=page_tables, starts=starts, lengths=lengths,
                     kernels=kernels)
    if real_kv is not None:
        attend = partial(_zero_padding_kv, attend, real_kv[:, None])
    return _decoder_layer(config, layer, x, positions, inv_freq, attend, reduce)


def _zero_padding_kv(attend: Callable, keep, q, k, v):
    return attend(q, jnp.where(keep, k, 0.0).astype(k.dtype), jnp.where(keep, v, 0.0).astype(v.dtype))


LOGPROB_ROWS = 256  # positions per call of the prompt-logprob program: one shape, whatever the batch and prompt


@partial(jax.jit, static_argnames=("config", "top_k"))
def next_token_logprobs(params, hidden, next_ids, *, config: ModelConfig, top_k: int):
    """For ``LOGPROB_ROWS`` positions, the logprob of the token that follows each (``hidden: [R, D]``,
    ``next_ids: [R]``), and with ``top_k`` the ``top_k`` most likely tokens there, ``(values, ids)`` each
    ``[R, top_k]`` (ties: the lower id first)."""
    logprobs = jax.nn.log_softmax(_logits(config, params, hidden.astype(config.dtype)), axis=-1)  # [R, V]
    chosen = jnp.take_along_axis(logprobs, next_ids[:, None], axis=-1)[:, 0]
    if not top_k:
        return chosen, None, None
    # from the same log-softmax as the chosen ones, so a greedy token's logprob equals its top value exactly
    return chosen, *jax.lax.top_k(logprobs, top_k)


def table_width(config: ModelConfig, num_pages: int, page_size: int) -> int:
    """Page-table columns every forward pass of a pool gets: enough for the longest sequence the pool and the model's
    positions allow, rounded up to whole attention blocks. Fixed per pool, so it never selects a program."""
    longest = min(config.max_position_embeddings, (num_pages - 1) * page_size)
    per_block = block_pages(page_size)
    return -(-pages_for_tokens(longest, page_size) // per_block) * per_block


def pages_for_tokens(tokens: int, page_size: int) -> int:
    return -(-tokens // page_size)


@partial(jax.jit, static_argnames=("config",))
def forward_reference(params, tokens, *, config: ModelConfig):
    """Logits ``[S, V]`` of every position of one contiguous sequence ``tokens: [S]``, with no KV pool at all."""
    positions = jnp.arange(tokens.shape[0], dtype=jnp.int32)[None, :]
    inv_freq = jnp.asarray(inverse_frequencies(config))
    x = params["embed"][tokens][None]  # [1, S, D]
    for layer in params["layers"]:
        attend = lambda q, k, v: (reference_attention(q[0], k[0], v[0])[None], None)
        x, _ = _decoder_layer(config, layer, x, positions, inv_freq, attend)
    return _logits(config, params, rms_norm(x, params["final_norm"], config.rms_norm_eps))[0]


@dataclass(frozen=True, slots=True)
class PrefillResult:
    logits: jax.Array  # [B, V] for prefill_batch, [V] for prefill: the last prompt position's logits
    pool: tuple
    # Per prompt position, the logprob of that token given the ones before it; None where there is no earlier token
    # in this call (the first one). Only when asked for.
    token_logprobs: list | None = None
    # Per prompt position, its ``k`` most likely tokens as ``(logprob, token_id)``, best first; None at the first
    # position. Only for prompts that asked for ``k > 0``.
    token_top_logprobs: list | None = None


def prefill_batch(
    config: ModelConfig,
    params: dict,
    pool: tuple,
    prompts: Sequence[Sequence[int]],
    page_ids: Sequence[Sequence[int]],
    *,
    start_positions: Sequence[int] | None = None,
    return_logprobs: bool = False,
    top_logprobs: Sequence[int] | None = None,
    bucket_rows: bool = False,
    forward: Callable | None = None,
    following: Sequence[int | None] | None = None,
) -> PrefillResult:
    """Prefill several prompts in one call; ``prompts[i]`` goes to positions ``start_positions[i]`` onwards.

    ``page_ids[i]`` are request ``i``'s pages in position order, covering positions ``[0, start + len)``; a non-zero
    start means the earlier positions are already in those pages (a cached prefix or an earlier chunk).
    ``top_logprobs[i]`` (with ``return_logprobs``; at most ``MAX_TOP_LOGPROBS``) asks for prompt ``i``'s alternatives.
    ``bucket_rows`` leaves the batch bucket's padding rows in ``logits``, as ``decode`` does and for the same reason.
    ``forward`` runs the pass (``programs.ForwardPrograms``: executables compiled ahead); default ``forward_paged``.
    ``following[i]``: the token after ``prompts[i]`` when it is one chunk of a longer prompt (else None): its logprob,
    given the chunk, ends that chunk's ``token_logprobs`` (and ``token_top_logprobs``).
    """
    if len(prompts) != len(page_ids) or not prompts:
        raise ValueError("prefill needs one page list per prompt, and at least one prompt")
    starts = list(start_positions) if start_positions is not None else [0] * len(prompts)
    page_size, num_pages = pool[0].shape[1], pool[0].shape[0]
    for prompt, pages, start in zip(prompts, page_ids, starts, strict=True):
        if not prompt:
            raise ValueError("cannot prefill an empty prompt")
        _check_pages(pages, start + len(prompt), page_size, num_pages)
    width = table_width(config, num_pages, page_size)
    b = input_buckets.batch_bucket(len(prompts))
    s = input_buckets.token_bucket(max(len(x) for x in prompts))
    logits, pool, hidden = (forward or partial(forward_paged, config=config))(
        params,
        pool,
        input_buckets.pad_2d(prompts, b, s),
        input_buckets.pad_1d(starts, b),
        input_buckets.pad_1d([len(x) for x in prompts], b),
        input_buckets.pad_2d([list(pages)[:width] for pages in page_ids], b, width, fill=PAD_PAGE),
    )
    token_logprobs = token_top = None
    if return_logprobs:
        ks = [min(int(k), MAX_TOP_LOGPROBS, config.vocab_size) for k in (top_logprobs or [0] * len(prompts))]
        # the executor's own program where it has one (compiled ahead), else the jitted function
        logprobs = getattr(forward, "next_token_logprobs", None) or partial(next_token_logprobs, config=config)
        token_logprobs, token_top = _prompt_logprobs(config, params, hidden, prompts, ks,
                                                     following or [None] * len(prompts), logprobs)
    return PrefillResult(logits if bucket_rows else logits[: len(prompts)], pool, token_logprobs, token_top)


def _prompt_logprobs(config: ModelConfig, params: dict, hidden, prompts, ks: list[int], following: list,
                     logprobs: Callable):
    """Each prompt's ``[None, logprob of token 1, ...]`` (and of its ``following`` token, if any), and its top-``k``
    rows where ``k`` > 0 (else None).

    The positions that predict a next prompt token are taken from ``hidden`` on the host and run in fixed blocks of
    ``LOGPROB_ROWS``, so this compiles one program (two with alternatives) for every batch and prompt length."""
    host = np.asarray(hidden, dtype=np.float32)
    nexts = [list(x[1:]) + ([] if f is None else [f]) for x, f in zip(prompts, following, strict=True)]
    rows = np.concatenate([host[i, : len(n)] for i, n in enumerate(nexts)])
    next_ids = np.concatenate([np.asarray(n, dtype=np.int32) for n in nexts])
    top_k = min(MAX_TOP_LOGPROBS, config.vocab_size) if any(ks) else 0
    chosen, values, ids = [], [], []
    for at in range(0, len(rows), LOGPROB_ROWS):
        block = np.zeros((LOGPROB_ROWS, rows.shape[1]), np.float32)
        block[: len(rows[at: at + LOGPROB_ROWS])] = rows[at: at + LOGPROB_ROWS]
        out = logprobs(params, block, input_buckets.pad_1d(next_ids[at: at + LOGPROB_ROWS], LOGPROB_ROWS), top_k=top_k)
        chosen.append(np.asarray(out[0]))
        if top_k:
            values.append(np.asarray(out[1]))
            ids.append(np.asarray(out[2]))
    chosen = np.concatenate(chosen) if chosen else np.zeros(0, np.float32)
    values, ids = (np.concatenate(values), np.concatenate(ids)) if values else (None, None)
    token_logprobs, token_top, at = [], [], 0
    for nxt, k in zip(nexts, ks, strict=True):
        n = len(nxt)
        token_logprobs.append([None] + chosen[at: at + n].tolist())
        token_top.append(_top_rows(values[at: at + n], ids[at: at + n], k) if k else None)
        at += n
    return token_logprobs, (token_top if top_k else None)


def _top_rows(values, ids, k: int) -> list:
    """``[None, [(logprob, id), ...], ...]``: the first position has nothing before it."""
    values, ids = values[:, :k].tolist(), ids[:, :k].tolist()
    return [None] + [list(zip(v, i, strict=True)) for v, i in zip(values, ids, strict=True)]


def prefill(
    config: ModelConfig,
    params: dict,
    pool: tuple,
    token_ids: Sequence[int],
    page_ids: Sequence[int],
    *,
    start_pos: int = 0,
    return_logprobs: bool = False,
    top_logprobs: int = 0,
    forward: Callable | None = None,
) -> PrefillResult:
    """Prefill one prompt into ``page_ids``; ``logits`` is ``[V]``, ``token_logprobs`` a list of ``len(token_ids)``."""
    out = prefill_batch(
        config, params, pool, [token_ids], [page_ids], start_positions=[start_pos], return_logprobs=return_logprobs,
        top_logprobs=[top_logprobs], forward=forward,
    )
    return PrefillResult(out.logits[0], out.pool, out.token_logprobs[0] if return_logprobs else None,
                         out.token_top_logprobs[0] if out.token_top_logprobs else None)


def decode(config: ModelConfig, params: dict, pool: tuple, tokens, positions, page_tables, *,
           bucket_rows: bool = False, forward: Callable | None = None) -> tuple[jax.Array, tuple]:
    """One decode step for a batch: ``tokens, positions: [B]``, ``page_tables: [B, max_pages]`` padded with page 0.

    ``positions[b]`` is where ``tokens[b]`` goes (the number of tokens already cached for that sequence). Returns
    logits ``[B, V]`` and the updated pool. Rows added to reach the batch bucket are all-pad: they write only to the
    pad page. ``bucket_rows`` returns those rows too (``[batch_bucket(B), V]``, for ``sampling.sample``): cutting
    them off on the device is a program per batch size, compiled the first time a batch of that exact size comes
    together (the soak saw each cost a serving node 0.6 to 2.5 MB, thousands of requests in: ``docs/serving.md``).
    """
    tokens = np.asarray(tokens, dtype=np.int32).reshape(-1)
    positions = np.asarray(positions, dtype=np.int32).reshape(-1)
    tables = np.asarray(page_tables, dtype=np.int32)
    n = tokens.shape[0]
    if positions.shape != (n,) or tables.ndim != 2 or tables.shape[0] != n:
        raise ValueError(
            f"decode shapes disagree: tokens {tokens.shape}, positions {positions.shape}, page_tables {tables.shape}"
        )
    page_size, num_pages = pool[0].shape[1], pool[0].shape[0]
    _check_decode_tables(tables, positions, page_size, num_pages)
    width = table_width(config, num_pages, page_size)
    b = input_buckets.batch_bucket(n)
    logits, pool, _ = (forward or partial(forward_paged, config=config))(
        params,
        pool,
        input_buckets.pad_1d(tokens, b)[:, None],
        input_buckets.pad_1d(positions, b),
        input_buckets.pad_1d(np.ones(n), b),
        input_buckets.pad_2d(tables[:, :width], b, width, fill=PAD_PAGE),
    )
    return (logits if bucket_rows else logits[:n]), pool


def _check_decode_tables(tables: np.ndarray, positions: np.ndarray, page_size: int, num_pages: int) -> None:
    # Vectorised: this runs every decode step, for every sequence of the batch.
    if (positions < 0).any():
        raise ValueError(f"negative decode positions: {positions.tolist()}")
    needed = positions // page_size + 1  # pages each row reads, the one receiving this token included
    if needed.max() > tables.shape[1]:
        raise ValueError(f"a position needs {int(needed.max())} pages; the page tables have {tables.shape[1]} columns")
    in_use = np.arange(tables.shape[1])[None, :] < needed[:, None]
    used = tables[in_use]
    if (used == PAD_PAGE).any():
        rows = sorted(set(np.nonzero((tables == PAD_PAGE) & in_use)[0].tolist()))
        raise ValueError(f"rows {rows} map positions to page {PAD_PAGE}, the reserved padding page")
    if (used < 0).any() or (used >= num_pages).any():
        raise ValueError(f"page ids out of range for a pool of {num_pages} pages")


def _check_pages(pages, num_tokens: int, page_size: int, num_pages: int) -> None:
    needed = -(-num_tokens // page_size)
    pages = [int(x) for x in pages]
    if len(pages) < needed:
        raise ValueError(f"{num_tokens} tokens need {needed} pages of {page_size}, got {len(pages)}")
    used = pages[:needed]
    if PAD_PAGE in used:
        raise ValueError(f"page {PAD_PAGE} is the reserved padding page and cannot hold a request's KV: {used}")
    if max(used) >= num_pages or min(used) < 0:
        raise ValueError(f"page ids {used} out of range for a pool of {num_pages} pages")
