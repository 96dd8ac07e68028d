"""Server warm-up: before a node serves, compile every program its configuration can form.

A program compiled while serving stalls the request that needed it (seconds on CPU for SmolLM2) and every request
batched with it, and grows the process. So a node compiles, before it answers ``/health``:

- its forward passes, ahead of time (``model.programs.ForwardPrograms``): prefill at every (batch, tokens) bucket
  its scheduler can form (``prefill_shapes``: every prefill step, a prefill node's, a colocated node's and a decode
  node's recomputes, stays within its chunked-prefill budget), and decode at every batch bucket up to
  ``max_running``;
- the samplers and the prompt-logprob program, by running them once per batch bucket on zeros;
- the page kernels a transfer runs (a decode node's scatters, whole and layer group by layer group; a prefill
  node's gathers where they are XLA programs), once per page bucket, into and out of free pages.

Everything goes through JAX's persistent compile cache, so a restart loads instead of compiling (``docs/serving.md``
has the start-up times, cold and warm). ``--skip-server-warmup`` (SGLang's flag) skips it; the programs then compile
as requests need them. ``engine.compiles`` counts what is compiled after this, so a shape missing here shows up.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import jax
import jax.numpy as jnp
import numpy as np

from fsm_pd.kernels import bucket_sizes, gather_pages, resolve_impl, scatter_layers, scatter_pages
from fsm_pd.kernels.placement import pool_placement
from fsm_pd.model import compiles, sampling
from fsm_pd.model.decoder import LOGPROB_ROWS, MAX_TOP_LOGPROBS, next_token_logprobs
from fsm_pd.model.pages import pages_for
from fsm_pd.model.programs import decode_shapes, prefill_shapes

log = logging.getLogger(__name__)


@dataclass
class WarmupPlan:
    """What one node compiles: forward shapes, sampler batch buckets, and page buckets of its transfer kernels."""

    forward: list[tuple[int, int]]
    sample_batches: list[int]
    scatter_buckets: list[int] = field(default_factory=list)  # a decode node's
    gather_buckets: list[int] = field(default_factory=list)  # a prefill node's

    @property
    def steps(self) -> int:
        return len(self.forward) + len(self.sample_batches) + 1 + len(self.scatter_buckets) + len(self.gather_buckets)


def plan_for(engine) -> WarmupPlan:
    """The plan of a prefill, decode or colocated engine, from the limits its schedulers batch by."""
    max_prompt = engine.max_context - 1
    prompt_buckets = bucket_sizes(pages_for(max_prompt, engine.page_size))
    if engine.role == "prefill":
        return WarmupPlan(prefill_shapes(engine.max_prefill_batch, engine.chunked_prefill_size),
                          _powers(engine.max_prefill_batch), gather_buckets=prompt_buckets)
    # prefills here: a colocated node's prompts, and both nodes' recomputes (retracted requests, failed transfers)
    limits = [(engine.loop.max_recompute_batch, engine.loop.max_recompute_tokens)]
    if engine.role == "colocated":
        limits.append((engine.max_prefill_batch, engine.chunked_prefill_size))
    else:
        limits.append((engine.recompute.max_batch, engine.recompute.max_tokens))
    forward = {shape for batch, tokens in limits for shape in prefill_shapes(batch, tokens)}
    forward |= set(decode_shapes(engine.max_running))
    plan = WarmupPlan(sorted(forward), _powers(max(engine.max_running, *(batch for batch, _ in limits))))
    if engine.role == "decode":
        plan.scatter_buckets = prompt_buckets
    return plan


def _powers(limit: int) -> list[int]:
    return sorted({b for b, _ in decode_shapes(limit)})


def warm_up(engine, *, progress: bool = True) -> dict:
    """Compile ``plan_for(engine)``; returns what it did and how long it took. Call before serving."""
    compiles.install()
    plan = plan_for(engine)
    started, before = time.monotonic(), compiles.counts()["startup"]
    with _Bar(progress, plan.steps, f"compiling {engine.role} programs") as bar:
        programs = engine.model.programs(engine.model_thread.pool)
        for shape in plan.forward:
            bar.describe(f"forward {shape[0]}x{shape[1]}")
            programs.compile(*shape)
            bar.advance()
        vocab = engine.model.config.vocab_size
        # jit's cache tells a committed array from a fresh one: sample logits placed as the forward pass leaves them
        logits_sharding = programs.compile(*plan.forward[0]).output_shardings[0]
        for batch in plan.sample_batches:
            bar.describe(f"sampling {batch}")
            _run_samplers(jax.device_put(np.zeros((batch, vocab), np.float32), logits_sharding))
            bar.advance()
        bar.describe("prompt logprobs")
        _run_logprobs(engine.model)
        bar.advance()
        if plan.scatter_buckets or plan.gather_buckets:
            engine.model_thread.call(lambda owner: _run_kernels(owner, engine.layout, plan, bar))
    took = time.monotonic() - started
    report = {"seconds": round(took, 2), "programs": compiles.counts()["startup"] - before,
              "forward_shapes": len(plan.forward)}
    log.info("warm-up: %d programs compiled or loaded from the compile cache in %.1f s (%d forward shapes)",
             report["programs"], took, report["forward_shapes"])
    return report


def _run_samplers(logits) -> None:
    batch, vocab = logits.shape
    zeros = np.zeros(batch, np.float32)
    sampling.greedy_tokens(logits).block_until_ready()
    sampling.sample_tokens(logits, zeros, zeros + 1, zeros.astype(np.int32), zeros, zeros.astype(np.uint32),
                           zeros.astype(np.int32)).block_until_ready()
    sampling.adjust_logits(logits, np.zeros((batch, vocab), np.float32), zeros, zeros, zeros + 1,
                           np.zeros((batch, vocab), np.float32)).block_until_ready()
    sampling.mask_logits(logits, np.full((batch, (vocab + 31) // 32), -1, np.int32)).block_until_ready()


def _run_logprobs(model) -> None:
    rows = np.zeros((LOGPROB_ROWS, model.config.hidden_size), np.float32)
    ids = np.zeros(LOGPROB_ROWS, np.int32)
    for top_k in (0, min(MAX_TOP_LOGPROBS, model.config.vocab_size)):
        next_token_logprobs(model.params, rows, ids, config=model.config, top_k=top_k)[0].block_until_ready()


def _run_kernels(owner, layout, plan: WarmupPlan, bar: _Bar) -> None:
    """On the model thread of an idle node: copy zeros into, and out of, free pages at every page bucket (a page
    that is free holds nothing anyone reads, and the first request to take it overwrites what it reads)."""
    from fsm_pd.control.overlap import layer_group

    usable = layout.num_pages - 1
    group = layer_group(layout)
    placement = pool_placement(owner.pool)  # a split pool's transfers land split like it (control/jax_kv.py)
    device = next(iter(owner.pool[0].sharding.device_set))
    for rows in plan.scatter_buckets:
        bar.describe(f"scatter {rows} pages")
        pages = list(range(1, min(rows, usable) + 1))
        staging = np.zeros(layout.staging_shape(rows), layout.dtype)
        if placement is None:
            # an array a transfer lands may be committed to the device or not (one more program each): both
            for landed in (jnp.asarray(staging), jax.device_put(staging, device)):
                owner.pool = scatter_pages(owner.pool, landed, pages, layout=layout)
        else:
            owner.pool = scatter_pages(owner.pool, jax.device_put(staging, placement.staging_sharding), pages,
                                       layout=layout)
        if placement is None:  # layers are streamed into a pool on one device only
            owner.pool = scatter_layers(owner.pool, 0, jnp.asarray(staging[:group]), pages)
        bar.advance()
    for rows in plan.gather_buckets:
        bar.describe(f"gather {rows} pages")
        if resolve_impl(owner.pool) != "cpu":  # the CPU gather is NumPy's: nothing to compile
            gather_pages(owner.pool, list(range(1, min(rows, usable) + 1)), layout=layout).block_until_ready()
        bar.advance()


class _Bar:
    """A rich progress bar on stderr, or nothing."""

    def __init__(self, shown: bool, total: int, title: str):
        self._progress = self._task = None
        if shown:
            from rich.console import Console
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

            self._progress = Progress(TextColumn(title + " {task.description}"), BarColumn(), MofNCompleteColumn(),
                                      TimeElapsedColumn(), console=Console(stderr=True))
            self._task = self._progress.add_task("", total=total)

    def __enter__(self) -> _Bar:
        if self._progress is not None:
            self._progress.start()
        return self

    def __exit__(self, *exc) -> None:
        if self._progress is not None:
            self._progress.stop()

    def describe(self, text: str) -> None:
        if self._progress is not None:
            self._progress.update(self._task, description=text)

    def advance(self) -> None:
        if self._progress is not None:
            self._progress.advance(self._task)
