"""The pool-free reference (``decoder.forward_reference``) for a test's sequences, one program per length bucket.

The reference is a jitted program of the sequence's length, and a test that checks greedy tokens one at a time asks
it for every length in turn: a program each (and one more for each ``logits[-1]`` taken on the device), compiled for
the chip on a TPU host, where each is a second or so. Here a sequence is padded with token 0 up to a power of two
(``bucket``) and the logits of its real positions kept. Attention is causal, so a position's logits do not depend on
what comes after it: the padding changes them only in summation order (at most 3e-6 on the tiny model, against the
checks' 2e-5 and up).
"""

from __future__ import annotations

import numpy as np

from fsm_pd.model.decoder import forward_reference

SMALLEST = 16


def bucket(length: int) -> int:
    return max(SMALLEST, 1 << (length - 1).bit_length())


def reference_logits(params, ids, *, config) -> np.ndarray:
    """``[len(ids), V]`` float32 on the host: row ``i`` the logits of the token after ``ids[: i + 1]``."""
    padded = np.zeros(bucket(len(ids)), np.int32)
    padded[:len(ids)] = ids
    # a host array, as jit takes it: ``jnp.asarray`` of one compiles a program of its shape (jax 0.10)
    return np.asarray(forward_reference(params, padded, config=config))[:len(ids)]


def greedy(params, prompt, steps: int, *, config) -> tuple[list[int], list[float]]:
    """``steps`` greedy tokens after ``prompt``, and each one's logprob (float64 on the host)."""
    tokens, logprobs = list(prompt), []
    for _ in range(steps):
        last = reference_logits(params, tokens, config=config)[-1].astype(np.float64)
        tokens.append(int(np.argmax(last)))
        logprobs.append(float(last[tokens[-1]] - last.max() - np.log(np.exp(last - last.max()).sum())))
    return tokens[len(prompt):], logprobs

