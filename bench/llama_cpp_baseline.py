"""llama.cpp on the same GGUF file, a second baseline for ``bench/model.py`` (SmolLM2 only, batch 1).

Optional: ``pip install llama-cpp-python`` (a source build: 451 s on this 2-core machine); never a dependency of
fsm-pd. llama.cpp runs the file's Q4_1 weights as they are, with its own quantized kernels, while fsm-pd and
transformers dequantize them to float32: the same model and file, not the same arithmetic. Its Python binding runs one
sequence, so only batch 1 is compared.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np


def importable() -> bool:
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        return False
    return True


class LlamaCppRunner:
    """One prefill of the prompt, then ``steps`` greedy decode steps, through llama.cpp (two threads)."""

    name = "llama.cpp"

    def __init__(self, path: Path, vocab: int, prompt_len: int, steps: int) -> None:
        import llama_cpp

        n_ctx = prompt_len + steps + 8
        # n_batch = n_ctx: the binding keeps one row of logits per batch position, indexed by the token's position
        self.model = llama_cpp.Llama(model_path=str(path), n_ctx=n_ctx, n_batch=n_ctx, n_threads=2, verbose=False)
        self.prompt = np.random.default_rng(0).integers(0, vocab, size=prompt_len).tolist()
        self.steps = steps

    def _next(self) -> int:
        return int(np.argmax(self.model.scores[self.model.n_tokens - 1]))

    def round(self) -> Iterator[float]:
        self.model.reset()
        start = time.perf_counter()
        self.model.eval(self.prompt)
        token = self._next()
        yield time.perf_counter() - start
        for _ in range(self.steps):
            start = time.perf_counter()
            self.model.eval([token])
            token = self._next()
            yield time.perf_counter() - start
