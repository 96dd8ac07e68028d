"""Top logprobs: the ``k`` most likely tokens at a position, as ``(logprob, token_id)`` pairs, best first (ties: the
lower id first). Output tokens' come from the step's logits here, on the host; prompt tokens' from the prefill
(``engine.model.prefill_batch``). A PD prefill sends the prompt's and the first output token's to the decode node in
READY's ``top_logprobs``: a compact string, because the room's events are journaled as JSON and the frame is capped.
"""

from __future__ import annotations

import base64
import struct
from collections.abc import Sequence

import numpy as np

from fsm_pd.model.decoder import MAX_TOP_LOGPROBS

TopRow = list[tuple[float, int]]
_HEADER = struct.Struct("<HI")  # k, rows

# What one READY may spend on top logprobs: the side channel's frames are capped at 1 MiB (transport.signing), and
# the prompt's own logprobs and the other fields travel in the same frame.
WIRE_BUDGET_BYTES = 640 * 1024


def log_softmax_rows(logits) -> np.ndarray:
    """``log_softmax(logits)`` over the last axis, in float32 on the host."""
    x = np.asarray(logits, dtype=np.float32)
    x = x - x.max(axis=-1, keepdims=True)
    return x - np.log(np.exp(x).sum(axis=-1, keepdims=True))


def chosen_and_top(logits, tokens, ks: Sequence[int]) -> tuple[np.ndarray, list[TopRow | None]]:
    """Each row's chosen token's logprob, and its top ``ks[b]`` (None where 0). Both come from one log-softmax, so a
    greedy token's logprob equals its row's best value exactly (lm-eval compares them to call a token greedy)."""
    lsm = log_softmax_rows(logits)
    chosen = lsm[np.arange(lsm.shape[0]), np.asarray(tokens)]
    tops: list[TopRow | None] = []
    for b, k in enumerate(ks):
        k = min(int(k), MAX_TOP_LOGPROBS, lsm.shape[-1])
        if k <= 0:
            tops.append(None)
            continue
        ids = np.argsort(-lsm[b], kind="stable")[:k]  # stable: equal values keep the lower id first
        tops.append(list(zip(lsm[b, ids].tolist(), ids.tolist(), strict=True)))
    return chosen, tops


def wire_bytes(k: int, prompt_len: int) -> int:
    """What ``to_wire`` makes of ``k`` alternatives for a prompt of ``prompt_len`` tokens (base64 included)."""
    raw = _HEADER.size + 8 * k * max(prompt_len, 1)
    return 4 * -(-raw // 3)


def to_wire(first: TopRow | None, prompt: list[TopRow | None] | None) -> str | None:
    """The first output token's row, then the prompt's (all but its first position, which has none), as base64 of
    ``k, rows`` then ``int32`` ids and ``float32`` logprobs: lossless, since both are computed in float32."""
    if not first:
        return None
    rows = [first, *(prompt or [None])[1:]]
    k = len(first)
    if any(row is None or len(row) != k for row in rows):
        raise ValueError("every row of top logprobs needs the same k")
    values = np.array([[lp for lp, _ in row] for row in rows], dtype=np.float32)
    ids = np.array([[tid for _, tid in row] for row in rows], dtype=np.int32)
    raw = _HEADER.pack(k, len(rows)) + ids.tobytes() + values.tobytes()
    return base64.b64encode(raw).decode("ascii")


def from_wire(text: str | None) -> tuple[TopRow | None, list[TopRow | None] | None]:
    """``(first, prompt)`` back from ``to_wire``; ``prompt`` has None at its first position. Raises ValueError on a
    malformed string."""
    if text is None:
        return None, None
    raw = base64.b64decode(text, validate=True)
    if len(raw) < _HEADER.size:
        raise ValueError("top logprobs: too short")
    k, n = _HEADER.unpack_from(raw)
    if k == 0 or n == 0 or len(raw) != _HEADER.size + 8 * k * n:
        raise ValueError(f"top logprobs: {len(raw)} bytes do not hold {n} rows of {k}")
    ids = np.frombuffer(raw, dtype=np.int32, count=k * n, offset=_HEADER.size).reshape(n, k).tolist()
    values = np.frombuffer(raw, dtype=np.float32, offset=_HEADER.size + 4 * k * n).reshape(n, k).tolist()
    rows = [list(zip(v, i, strict=True)) for v, i in zip(values, ids, strict=True)]
    return rows[0], [None, *rows[1:]]
