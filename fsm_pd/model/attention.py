"""Attention over the paged KV pool (see ``fsm_pd.kernels.layout``), and a contiguous reference to check it against.

Every sequence of a batch is described by its page table (page ids in position order, padded with the pad page to
the node's fixed table width), the position of its first new token (``start``) and how many of its ``S`` token slots
are real (``length``).

A call first stores the new tokens' K/V in their pages, then attends over the pages holding positions
``[0, start + length)``, a block of pages at a time with an online softmax (flash-attention's running max and sum).
Two properties follow, and both are why it is built this way:

- The cost follows the batch's context, not the pool or the table width: the loop runs as many blocks as the longest
  context in the batch needs, so one compiled program serves every context length (the table width is not a
  compile-time dimension, and a step at 4096 pages costs what it costs at 64).
- The pool is written in place. The write comes first and the loop reads what it wrote, so XLA needs a single
  version of the donated pool. Reading the pool beside an independent write, or gathering the written pool in the
  same fusion as the write, makes XLA keep two versions and copy the whole layer on every step
  (``tests/unit/test_step_cost.py`` holds it to that).
"""

from __future__ import annotations

import os
from functools import partial
from typing import Literal

import jax
import jax.numpy as jnp

from fsm_pd.kernels.layout import PAD_PAGE

ATTENTION_ENV = "FSM_PD_ATTENTION"

# Finite, so a row with every key masked (a padding row) softmaxes to uniform weights instead of NaN.
MASK_VALUE = -1e30
BLOCK_TOKENS = 64  # positions per attention block (whole pages): 64 and 128 beat 32 and 256 on CPU (model.md)
TPU_BLOCK_TOKENS = 512  # on a TPU: few loop steps; each block's products are large enough for its matrix units


def block_pages(page_size: int) -> int:
    """Pages per attention block (``model.table_width`` makes page tables a multiple of it)."""
    return max(1, BLOCK_TOKENS // page_size)


def slot_indices(page_tables, starts, lengths, seq_len: int, page_size: int):
    """Pool coordinates ``(pages, offsets)``, each ``[B, S]``, where each new token's K/V goes.

    Padding tokens (``s >= length``) go to slot 0 of the pad page, which is never read as real KV.
    """
    steps = jnp.arange(seq_len, dtype=jnp.int32)
    positions = starts[:, None] + steps[None, :]  # [B, S]
    real = steps[None, :] < lengths[:, None]
    page_index = jnp.clip(positions // page_size, 0, page_tables.shape[1] - 1)
    pages = jnp.take_along_axis(page_tables, page_index, axis=1)
    pages = jnp.where(real, pages, PAD_PAGE)
    offsets = jnp.where(real, positions % page_size, 0)
    return pages, offsets


def kv_rows(k, v, dtype):
    """``k, v: [B, S, kv_heads, head_dim]`` as pool rows ``[B, S, 2 * kv_heads * head_dim]``: ``[K0, V0, K1, ...]``."""
    b, s, kv_heads, head_dim = k.shape
    return jnp.stack([k, v], axis=3).reshape(b, s, 2 * kv_heads * head_dim).astype(dtype)


def write_kv(layer_pool, k, v, pages, offsets):
    """Scatter ``k, v: [B, S, kv_heads, head_dim]`` into ``layer_pool: [N, page_size, 2*kv_heads*head_dim]``."""
    return layer_pool.at[pages, offsets].set(kv_rows(k, v, layer_pool.dtype))


def attend_pages(q, layer_pool, page_tables, q_positions, kv_lengths, *, block_tokens: int = BLOCK_TOKENS,
                 operands=jnp.float32):
    """Causal GQA of ``q: [B, S, H, D]`` over the pool's pages, where table slot ``t`` holds position ``t``.

    ``q_positions: [B, S]`` are the queries' positions, ``kv_lengths: [B]`` how many positions hold real KV.
    ``page_tables: [B, W]``. Returns ``[B, S, H, D]``. ``operands``: the dtype the products take (their sums are
    float32 either way); a TPU multiplies bfloat16 several times faster than float32, whose products there are
    asked for at full precision.
    """
    b, s, heads, dim = q.shape
    _, page_size, lanes = layer_pool.shape
    kv_heads = lanes // (2 * dim)
    operands = jnp.dtype(operands)
    precision = jax.lax.Precision.HIGHEST if operands == jnp.float32 else None
    product = partial(jnp.einsum, precision=precision, preferred_element_type=jnp.float32)
    per_block = min(max(1, block_tokens // page_size), page_tables.shape[1])
    if page_tables.shape[1] % per_block:  # whole blocks only (static: a table narrower than its node's never is)
        page_tables = jnp.pad(page_tables, ((0, 0), (0, per_block - page_tables.shape[1] % per_block)))
    tokens = per_block * page_size
    grouped = (q.reshape(b, s, kv_heads, heads // kv_heads, dim).astype(jnp.float32) * (dim**-0.5)).astype(operands)
    blocks = (jnp.max(kv_lengths) + tokens - 1) // tokens

    def block(i, carry):
        running_max, total, acc = carry
        table = jax.lax.dynamic_slice_in_dim(page_tables, i * per_block, per_block, axis=1)  # [B, per_block]
        kv = layer_pool[table].reshape(b, tokens, kv_heads, 2, dim).astype(operands)
        scores = product("bskgd,btkd->bkgst", grouped, kv[:, :, :, 0])
        t = i * tokens + jnp.arange(tokens, dtype=jnp.int32)
        visible = (t[None, None, :] <= q_positions[:, :, None]) & (t[None, None, :] < kv_lengths[:, None, None])
        scores = jnp.where(visible[:, None, None], scores, MASK_VALUE)
        new_max = jnp.maximum(running_max, scores.max(axis=-1))
        weights = jnp.exp(scores - new_max[..., None])
        scale = jnp.exp(running_max - new_max)
        total = total * scale + weights.sum(axis=-1)
        acc = acc * scale[..., None] + product("bkgst,btkd->bkgsd", weights.astype(operands), kv[:, :, :, 1])
        return new_max, total, acc

    shape = (b, kv_heads, heads // kv_heads, s)
    start = (jnp.full(shape, MASK_VALUE, jnp.float32), jnp.zeros(shape, jnp.float32),
             jnp.zeros((*shape, dim), jnp.float32))
    _, total, acc = jax.lax.fori_loop(0, blocks, block, start)
    out = acc / total[..., None]  # [B, KVH, G, S, D]
    return out.transpose(0, 3, 1, 2, 4).reshape(b, s, heads, dim).astype(q.dtype)


Kernels = Literal["jnp", "tpu", "interpret"]


def kernels_for(pool, head_dim: int) -> Kernels:
    """Which attention code a pool gets: on a pool on TPU devices whose ``head_dim`` the TPU kernels take (64 or a
    multiple of 128), the TPU kernels (``decode_attention``, ``kernels.kv_write``); jnp elsewhere.
    ``FSM_PD_ATTENTION`` overrides: ``jnp`` keeps the jnp path on a TPU too, ``tpu`` is the default's rule, and
    ``interpret`` runs the TPU kernels in Pallas's interpret mode on any device (slow, for tests). The kernels are the
    chip's default since they matched the float32 CPU reference there as jnp does (``bench/chip_parity.py``, SmolLM2's
    shape: 127 of 128 greedy steps, the other a near tie, on both; the multi-step loop 112 of 112), and decoded
    SmolLM2 2.89x faster than jnp at batch 64 and 1.33x at batch 8, the same at batch 1 (``docs/tpu-rounds.md``, "Sixth
    round"). Their cost: about a second of tracing per decode program at every start (the persistent cache keeps
    compiled programs, not traces): a warm colocated SmolLM2 node was ready in 18.4 s against jnp's 12.9."""
    forced = os.environ.get(ATTENTION_ENV)
    if forced not in (None, "", "jnp", "tpu", "interpret"):
        raise ValueError(f"{ATTENTION_ENV}={forced!r}: use jnp, tpu or interpret")
    if forced == "jnp":
        return "jnp"
    on_tpu = next(iter(pool[0].sharding.device_set)).platform == "tpu"
    if forced != "interpret" and not on_tpu:
        return "jnp"  # Pallas: 0.3 s of a start that never uses it (imported below only)
    from fsm_pd.model import decode_attention

    if not decode_attention.supported(head_dim):
        return "jnp"
    return "interpret" if forced == "interpret" else "tpu"


def paged_attention(q, k, v, layer_pool, page_tables, starts, lengths, *, kernels: Kernels = "jnp"):
    """Store the new tokens' K/V in the pool, then attend over each sequence's whole cached context.

    ``q: [B, S, H, D]``, ``k, v: [B, S, KVH, D]`` for the tokens at positions ``starts + [0, S)``. Returns the
    attention output ``[B, S, H, D]`` and the updated layer pool. ``kernels`` (``kernels_for``): on a TPU, decode
    (``S`` = 1) is one Pallas kernel that writes the new K/V and attends (``decode_attention``); prefill writes by
    whole pages (``kernels.kv_write``: XLA's scatter there passes over the whole pool) and attends with the jnp loop
    below in the pool's dtype.
    """
    _, seq_len = q.shape[:2]
    interpret = kernels == "interpret"
    if kernels != "jnp":  # the TPU kernels: Pallas, imported only where they run
        from fsm_pd.kernels import kv_write
        from fsm_pd.model import decode_attention
    if kernels != "jnp" and seq_len == 1:
        return decode_attention.decode_step(q, k, v, layer_pool, page_tables, starts, lengths, interpret=interpret)
    if kernels == "jnp":
        pages, offsets = slot_indices(page_tables, starts, lengths, seq_len, layer_pool.shape[1])
        layer_pool = write_kv(layer_pool, k, v, pages, offsets)
    else:
        layer_pool = kv_write.write_rows(layer_pool, kv_rows(k, v, layer_pool.dtype), page_tables, starts, lengths,
                                         interpret=interpret)
    q_positions = starts[:, None] + jnp.arange(seq_len, dtype=jnp.int32)[None, :]
    if kernels == "jnp":
        return attend_pages(q, layer_pool, page_tables, q_positions, starts + lengths), layer_pool
    return attend_pages(q, layer_pool, page_tables, q_positions, starts + lengths, block_tokens=TPU_BLOCK_TOKENS,
                        operands=layer_pool.dtype), layer_pool


def reference_attention(q, k, v):
    """Plain causal attention of one contiguous sequence: ``q: [S, H, D]``, ``k, v: [S, KVH, D]`` -> ``[S, H, D]``.

    Deliberately written the textbook way (KV heads repeated, an explicit lower-triangular mask) so it shares no
    indexing logic with the paged path it is used to check.
    """
    s, heads, dim = q.shape
    repeat = heads // k.shape[1]
    k = jnp.repeat(k, repeat, axis=1)  # [S, H, D]
    v = jnp.repeat(v, repeat, axis=1)
    scores = jnp.einsum("qhd,khd->hqk", q, k) / jnp.sqrt(jnp.float32(dim))
    causal = jnp.tril(jnp.ones((s, s), dtype=bool))
    scores = jnp.where(causal[None], scores, -jnp.inf)
    return jnp.einsum("hqk,khd->qhd", jax.nn.softmax(scores, axis=-1), v)
