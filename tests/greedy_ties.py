"""Compare two greedy outputs of the tiny model, allowing a split only where the model itself cannot tell.

Greedy tokens from two runs of the same prompt are equal unless the top two logits are so close that a different
batch or bucket shape (another summation order in XLA) reorders them. The tiny model has such ties: "stream 20: the
quick brown fox" puts tokens 106 and 22 4.8e-7 apart, and a CI run under load picked the other one. A split there is
arithmetic, not a bug; a split anywhere else means the KV or the scheduling is wrong.
"""

from __future__ import annotations

from functools import lru_cache

import jax.numpy as jnp
import numpy as np

# float32 noise between batch shapes is ~1e-6 on these logits; a real fault (wrong KV, a page mixed up) moves them by
# far more than this.
TIE = 1e-4


@lru_cache(maxsize=1)
def _tiny():
    from fsm_pd.model.tiny import tiny_model_parts

    return tiny_model_parts()


def tiny_prompt_ids(text: str) -> list[int]:
    """The ids the servers feed the tiny model for ``text``."""
    return _tiny()[2].encode(text)


def tie_gap(prompt: list[int], before: list[int], a: int, b: int) -> float:
    """How far below the best logit the weaker of ``a`` and ``b`` is, after ``prompt + before``, by the tiny model
    run with no pool and no batch (``forward_reference``)."""
    from fsm_pd.model.decoder import forward_reference

    config, params, _ = _tiny()
    logits = np.asarray(forward_reference(params, jnp.asarray(prompt + before, dtype=jnp.int32), config=config))[-1]
    return float(logits.max() - min(logits[a], logits[b]))


def split_at_a_tie(prompt: list[int], a: list[int], b: list[int]) -> str | None:
    """None when ``a`` and ``b`` are the same greedy output, or split where their two tokens tie within ``TIE`` (what
    follows a tie is not compared: each run went on from its own token); else what is wrong, in words."""
    split = next((k for k, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), None)
    if split is None:
        return None if len(a) == len(b) else f"lengths differ: {len(a)} and {len(b)}"
    gap = tie_gap(prompt, a[:split], a[split], b[split])
    if gap <= TIE:
        return None
    return f"token {split}: {a[split]} and {b[split]}, the weaker {gap:.3g} below the best logit (a tie is {TIE})"
