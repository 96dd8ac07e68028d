"""Shape bucketing: the one place that decides which padded shapes the jitted model functions see.

XLA compiles one program per input shape. Rounding the prompt length and the batch up to a power of two bounds the
number of programs a running server ever compiles to a few per dimension, at the price of at most 2x padding. The
page table does not vary: every forward pass gets the pool's fixed width (``decoder.table_width``). Staging arrays
round their page counts by the kernels' own rule (``fsm_pd.kernels.page_buckets``).
"""

from __future__ import annotations

import numpy as np

MIN_TOKEN_BUCKET = 16  # below this, padding costs nothing worth another program
MIN_BATCH_BUCKET = 1


def next_power_of_two(n: int) -> int:
    if n < 1:
        return 1
    return 1 << (n - 1).bit_length()


def token_bucket(n: int) -> int:
    """Padded length for ``n`` prompt tokens."""
    return max(MIN_TOKEN_BUCKET, next_power_of_two(n))


def batch_bucket(n: int) -> int:
    """Padded batch size for ``n`` sequences."""
    return max(MIN_BATCH_BUCKET, next_power_of_two(n))


def prefill_fits(batch: int, tokens: int, max_tokens: int) -> bool:
    """Whether a prefill of ``batch`` prompts padded to ``tokens`` each fits a budget of ``max_tokens`` padded
    tokens; one prompt always fits (the context bounds it). Schedulers batch by this rule and warm-up compiles by it
    (``forward_shapes.prefill_shapes``): the padded shape, not the real tokens, is what a program costs and what selects
    it."""
    return batch_bucket(batch) == 1 or batch_bucket(batch) * token_bucket(tokens) <= token_bucket(max_tokens)


def pad_1d(values, size: int, fill: int = 0, dtype=np.int32) -> np.ndarray:
    """``values`` padded with ``fill`` to ``size`` entries (host side, so padding never triggers a device compile)."""
    arr = np.asarray(values, dtype=dtype).reshape(-1)
    if arr.shape[0] > size:
        raise ValueError(f"{arr.shape[0]} values do not fit in a bucket of {size}")
    out = np.full((size,), fill, dtype=dtype)
    out[: arr.shape[0]] = arr
    return out


def pad_2d(rows, num_rows: int, num_cols: int, fill: int = 0, dtype=np.int32) -> np.ndarray:
    """A ``[num_rows, num_cols]`` array holding ``rows`` (each possibly shorter), the rest ``fill``."""
    out = np.full((num_rows, num_cols), fill, dtype=dtype)
    if len(rows) > num_rows:
        raise ValueError(f"{len(rows)} rows do not fit in a bucket of {num_rows}")
    for i, row in enumerate(rows):
        row = np.asarray(row, dtype=dtype).reshape(-1)
        if row.shape[0] > num_cols:
            raise ValueError(f"row {i} has {row.shape[0]} entries, more than the bucket width {num_cols}")
        out[i, : row.shape[0]] = row
    return out
