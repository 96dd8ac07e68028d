"""The decode loop's dispatches of several steps (``model/multi_step.py``): which sequences can take them, each
row's inputs and budget, and the tokens coming back.

A sequence samples on the device unless it needs the host for a token: logprobs, a grammar mask, penalties or a
logit bias (they read the logits on the host), or more stop tokens than the device checks. A batch holding one such
sequence decodes a step at a time (``DecodeLoop``).

A row's budget is what it may generate in this dispatch: what its ``max_new_tokens`` and the context leave, and what
the pages it holds can store; the decode loop reserves pages ahead for the dispatch's steps first. The tokens come
back through ``copy_to_host_async``, started as the dispatch goes: they travel as soon as the device has them, and
the host reads them when it next needs them (``Dispatch.wait``).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field

import jax
import numpy as np

from fsm_pd.kvpool.pages import pages_for
from fsm_pd.model.loader import LoadedModel
from fsm_pd.model.model_thread import ModelThread
from fsm_pd.model.multi_step import MAX_STOP_IDS, StepRow, pack
from fsm_pd.serving.sequence import Sequence

STEPS_ENV = "FSM_PD_DECODE_STEPS_PER_DISPATCH"
# On an accelerator: 8. Served on a TPU v5e (SmolLM2 from its GGUF, 16 streams, warm, round r12: bench/load.py
# --targets colocated+k8,colocated), 8 steps a dispatch gave 1.17 / 3.29 / 1.90x the output tok/s of one step at a
# time on prefill-heavy / decode-heavy / mixed (5,873 tok/s decode-heavy, TPOT p50 1.8 ms against 7.1), at the same
# TTFT, and the same /health time warm (12.0 s against 12.1); its loop programs compile in the background.
ACCELERATOR_STEPS = 8
# On the CPU the host's share of a step is small beside the model's (docs/serving.md, "Several decode steps a
# dispatch"): a step at a time, as before.
CPU_STEPS = 1


def steps_per_dispatch(value: int | None, pool) -> int:
    """``--decode-steps-per-dispatch``, else ``FSM_PD_DECODE_STEPS_PER_DISPATCH``, else by where the pool is."""
    if value is None and os.environ.get(STEPS_ENV):
        value = int(os.environ[STEPS_ENV])
    if value is None:
        platform = next(iter(pool[0].sharding.device_set)).platform
        value = CPU_STEPS if platform == "cpu" else ACCELERATOR_STEPS
    if value < 1:
        raise ValueError(f"decode steps per dispatch must be at least 1, got {value}")
    return value


def samples_on_device(seq: Sequence) -> bool:
    """Whether every token of ``seq`` can be sampled and stop-checked on the device."""
    request, params = seq.request, seq.request.sampling
    return not (request.return_logprob or params.grammar is not None or params.adjusts_logits
                or len(seq.checker.stop_ids) > MAX_STOP_IDS)


def finish_budget(seq: Sequence) -> int:
    """Tokens ``seq`` may still generate: what its ``max_new_tokens`` and the context leave (at least 1 while it
    runs)."""
    left = min(seq.request.sampling.max_new_tokens - seq.generated, seq.max_context - seq.prompt_len - seq.generated)
    return max(1, left)


def pages_ahead(seq: Sequence, steps: int, page_size: int) -> int:
    """The pages ``seq`` needs to take ``steps`` more steps (fewer if it finishes sooner)."""
    return pages_for(seq.next_position + min(steps, finish_budget(seq)), page_size)


@dataclass(eq=False)
class Dispatch:
    """A dispatch in flight: its rows in order, the steps asked for, and its tokens ``[B, max_steps]`` on their
    way to the host."""

    rows: list[Sequence]
    steps: int
    tokens: jax.Array
    dispatched_at: float = field(default_factory=time.perf_counter)

    def ready(self) -> bool:
        return self.tokens.is_ready()

    def wait(self) -> np.ndarray:
        """Each row's tokens, ``[len(rows), max_steps]`` (-1 after the row stopped), once the device has them."""
        return np.asarray(self.tokens)[: len(self.rows)]


def dispatch(model: LoadedModel, owner: ModelThread, batch: list[Sequence], steps: int, max_steps: int,
             page_size: int, max_running: int) -> Dispatch | None:
    """Start up to ``steps`` decode steps of ``batch`` (every row samples on the device, each holds the pages its
    steps need, up to what it holds) on the model thread; None where the program for its shape is not compiled yet
    and something is compiling it (a serving node's warm-up): the caller decodes a step at a time meanwhile."""
    programs = model.programs(owner.pool)
    loops = programs.steps
    if loops is None:
        return None
    rows, widest = [], 1
    for seq in batch:
        budget = min(finish_budget(seq), len(seq.pages) * page_size - seq.next_position)
        used = pages_for(seq.next_position + min(steps, budget), page_size)
        widest = max(widest, used)
        params = seq.request.sampling
        rows.append(StepRow(seq.last_token, seq.next_position, budget, seq.pages[:used], seed=seq.request.seed,
                            step=seq.step, temperature=params.temperature, top_p=params.top_p, top_k=params.top_k,
                            min_p=params.min_p, stop_ids=tuple(sorted(seq.checker.stop_ids))))
    shape = loops.find(loops.batch_for(len(rows), max_running), loops.width_for(widest), max_steps,
                       compile_missing=not programs.covers)
    if shape is None:
        return None
    packed = pack(rows, *shape, steps, model.config.vocab_size)
    tokens, owner.pool = loops.run(model.params, owner.pool, packed, max_steps)
    tokens.copy_to_host_async()
    return Dispatch(list(batch), steps, tokens)
