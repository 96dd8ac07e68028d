"""The shapes a node's forward programs are compiled for, and what running rows on one of them costs.

A node compiles ahead (``programs.py``) every (batch bucket, token bucket) its configuration can form: the prefill
shapes its token budget allows (``prefill_shapes``) and one decode shape per batch bucket (``decode_shapes``). A
forward pass runs its layers in groups, one program per group size (``layer_groups``). A call whose shape is not
compiled yet runs on one that covers it, chosen by ``call_cost``.
"""

from __future__ import annotations

from fsm_pd.model import input_buckets


def prefill_shapes(max_batch: int, max_tokens: int) -> list[tuple[int, int]]:
    """Every (batch bucket, token bucket) a prefill step can form: up to ``max_batch`` chunks whose padded size stays
    within ``max_tokens`` (``input_buckets.prefill_fits``; a longer prompt is prefilled in chunks of at most that)."""
    shapes = []
    for batch in _powers_up_to(input_buckets.batch_bucket(max_batch)):
        for tokens in _powers_up_to(input_buckets.token_bucket(max_tokens), start=input_buckets.MIN_TOKEN_BUCKET):
            if input_buckets.prefill_fits(batch, tokens, max_tokens):
                shapes.append((batch, tokens))
    return shapes


def decode_shapes(max_running: int) -> list[tuple[int, int]]:
    """Every (batch bucket, 1) a decode step of up to ``max_running`` sequences can form."""
    return [(batch, 1) for batch in _powers_up_to(input_buckets.batch_bucket(max_running))]


def layer_groups(num_layers: int, target: int) -> list[tuple[int, int]]:
    """``(first layer, count)`` of each group a forward pass runs as one program call, in order.

    Groups of one size where the depth allows it (a divisor of ``num_layers`` near ``target``: SmolLM2's 30 layers
    are 5 groups of 6), so one program serves every group; otherwise near-equal groups, of two sizes at most."""
    target = max(1, target)
    sizes = [d for d in range(max(1, target // 2), 2 * target + 1) if num_layers % d == 0]
    if sizes:
        size = min(sizes, key=lambda d: (abs(d - target), -d))
        return [(first, size) for first in range(0, num_layers, size)]
    count = -(-num_layers // target)
    base, extra = divmod(num_layers, count)
    groups, first = [], 0
    for size in [base] * (count - extra) + [base + 1] * extra:
        groups.append((first, size))
        first += size
    return groups


def _powers_up_to(limit: int, start: int = 1) -> list[int]:
    out, value = [], start
    while value <= limit:
        out.append(value)
        value *= 2
    return out


# What one call of a forward program costs beside its rows' tokens, in tokens: a decode step is bound by reading
# the weights, whatever its rows (SmolLM2 on a TPU v5e, jnp: 2.0 ms a call and 0.16 ms a row, from bench/tpu.py's
# 3.36 ms at batch 8 and 12.49 ms at 64; with the TPU kernels 0.06 ms a row). So a 16-row decode batch runs padded
# up to the node's largest decode program (one call) rather than as 16 single-row calls, and 2 rows run row by row
# rather than padded to 64.
CALL_TOKENS = 16


def call_cost(batch: int, shape: tuple[int, int]) -> int:
    """The cost of ``batch`` rows on the compiled ``shape``, in tokens: ``ceil(batch / rows)`` calls, each of
    ``rows * tokens`` padded tokens and ``CALL_TOKENS``."""
    rows, tokens = shape
    return -(-batch // rows) * (CALL_TOKENS + rows * tokens)
