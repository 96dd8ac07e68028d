"""Rotary position embeddings in HF's "rotate half" convention (the first and second halves of a head pair up)."""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np

from fsm_pd.model.config import ModelConfig


def inverse_frequencies(config: ModelConfig) -> np.ndarray:
    """Per-pair rotation rates ``[head_dim // 2]``, after the config's rope scaling.

    Computed on the host in float64 so that the table is identical to the reference implementation's up to the final
    float32 rounding, whatever the backend.
    """
    dim = config.head_dim
    inv = 1.0 / (config.rope_theta ** (np.arange(0, dim, 2, dtype=np.float64) / dim))
    scaling = config.rope_scaling
    if scaling is None:
        return inv.astype(np.float32)
    if scaling.rope_type == "linear":
        return (inv / scaling.factor).astype(np.float32)
    # llama3: long wavelengths (beyond the original context) are slowed by ``factor``, short ones kept, and the band
    # between is blended linearly in 1/wavelength so that the spectrum stays continuous.
    old_ctx = scaling.original_max_position_embeddings
    low_wavelen = old_ctx / scaling.low_freq_factor
    high_wavelen = old_ctx / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv
    smooth = (old_ctx / wavelen - scaling.low_freq_factor) / (scaling.high_freq_factor - scaling.low_freq_factor)
    blended = (1 - smooth) * inv / scaling.factor + smooth * inv
    out = np.where(wavelen > low_wavelen, inv / scaling.factor, inv)
    in_band = (wavelen <= low_wavelen) & (wavelen >= high_wavelen)
    return np.where(in_band, blended, out).astype(np.float32)


def apply_rope(x: jnp.ndarray, positions: jnp.ndarray, inv_freq: jnp.ndarray) -> jnp.ndarray:
    """Rotate ``x: [B, S, heads, head_dim]`` by the angle of each token's position ``positions: [B, S]``."""
    angles = positions.astype(jnp.float32)[..., None] * inv_freq  # [B, S, D/2]
    cos = jnp.cos(angles)[:, :, None, :]
    sin = jnp.sin(angles)[:, :, None, :]
    x32 = x.astype(jnp.float32)
    first, second = jnp.split(x32, 2, axis=-1)
    rotated = jnp.concatenate([first * cos - second * sin, second * cos + first * sin], axis=-1)
    return rotated.astype(x.dtype)
