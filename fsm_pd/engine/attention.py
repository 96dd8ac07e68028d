"""Attention over the paged KV pool (see ``fsm_pd.kernels.layout``), and a contiguous reference to check it against.

Every sequence of a batch is described by its page table ``[P]`` (page ids in position order, padded with the pad
page), the position of its first new token (``start``) and how many of its ``S`` token slots are real (``length``).
New K/V are scattered into the pool first, then each sequence's pages are gathered back in order, so gathered slot
``t`` holds position ``t`` and a causal mask on ``t <= query position`` is all the masking needed.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from fsm_pd.kernels.layout import PAD_PAGE

# Finite, so a row with every key masked (a padding row) softmaxes to uniform weights instead of NaN.
MASK_VALUE = -1e30


def slot_indices(page_tables, starts, lengths, seq_len: int, page_size: int):
    """Pool coordinates ``(pages, offsets)``, each ``[B, S]``, where each new token's K/V goes.

    Padding tokens (``s >= length``) go to slot 0 of the pad page, which is never read as real KV.
    """
    # page_tables: [B, P]; starts, lengths: [B]
    steps = jnp.arange(seq_len, dtype=jnp.int32)
    positions = starts[:, None] + steps[None, :]  # [B, S]
    real = steps[None, :] < lengths[:, None]
    page_index = jnp.clip(positions // page_size, 0, page_tables.shape[1] - 1)
    pages = jnp.take_along_axis(page_tables, page_index, axis=1)
    pages = jnp.where(real, pages, PAD_PAGE)
    offsets = jnp.where(real, positions % page_size, 0)
    return pages, offsets


def write_kv(layer_pool, k, v, pages, offsets):
    """Scatter ``k, v: [B, S, kv_heads, head_dim]`` into ``layer_pool: [N, page_size, 2*kv_heads, head_dim]``."""
    b, s, kv_heads, head_dim = k.shape
    interleaved = jnp.stack([k, v], axis=3).reshape(b, s, 2 * kv_heads, head_dim)  # [K0, V0, K1, V1, ...]
    return layer_pool.at[pages, offsets].set(interleaved.astype(layer_pool.dtype))


def gather_kv(layer_pool, page_tables):
    """Each sequence's K and V in position order, each ``[B, P * page_size, kv_heads, head_dim]``."""
    b, p = page_tables.shape
    _, page_size, two_kv, head_dim = layer_pool.shape
    pages = layer_pool[page_tables]  # [B, P, page_size, 2*kv_heads, head_dim]
    kv = pages.reshape(b, p * page_size, two_kv // 2, 2, head_dim)
    return kv[:, :, :, 0, :], kv[:, :, :, 1, :]


def grouped_attention(q, k, v, q_positions, kv_lengths):
    """Causal GQA of ``q: [B, S, H, D]`` over ``k, v: [B, T, KVH, D]`` where slot ``t`` holds position ``t``.

    ``q_positions: [B, S]`` are the queries' positions, ``kv_lengths: [B]`` how many slots hold real KV.
    """
    b, s, heads, dim = q.shape
    kv_heads = k.shape[2]
    grouped = q.reshape(b, s, kv_heads, heads // kv_heads, dim)
    scores = jnp.einsum("bskgd,btkd->bkgst", grouped, k.astype(q.dtype)) * (dim**-0.5)
    t = jnp.arange(k.shape[1], dtype=jnp.int32)
    visible = (t[None, None, :] <= q_positions[:, :, None]) & (t[None, None, :] < kv_lengths[:, None, None])
    scores = jnp.where(visible[:, None, None, :, :], scores.astype(jnp.float32), MASK_VALUE)
    probs = jax.nn.softmax(scores, axis=-1).astype(q.dtype)  # [B, KVH, G, S, T]
    out = jnp.einsum("bkgst,btkd->bskgd", probs, v.astype(q.dtype))
    return out.reshape(b, s, heads, dim)


def paged_attention(q, k, v, layer_pool, page_tables, starts, lengths):
    """Store the new tokens' K/V in the pool, then attend over each sequence's whole cached context.

    ``q: [B, S, H, D]``, ``k, v: [B, S, KVH, D]`` for the tokens at positions ``starts + [0, S)``. Returns the
    attention output ``[B, S, H, D]`` and the updated layer pool.
    """
    _, seq_len = q.shape[:2]
    page_size = layer_pool.shape[1]
    pages, offsets = slot_indices(page_tables, starts, lengths, seq_len, page_size)
    layer_pool = write_kv(layer_pool, k, v, pages, offsets)
    cached_k, cached_v = gather_kv(layer_pool, page_tables)
    q_positions = starts[:, None] + jnp.arange(seq_len, dtype=jnp.int32)[None, :]
    out = grouped_attention(q, cached_k, cached_v, q_positions, starts + lengths)
    return out, layer_pool


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
