"""Server warm-up: a node is ready as soon as it can serve any request without a compile, and compiles the rest of
what its configuration can form in the background.

A program compiled while serving stalls the request that needed it (seconds on CPU for SmolLM2) and every request
batched with it. Compiling everything first stalls the start instead (minutes for SmolLM2 on 2 cores). So a node
prepares, before it answers ``/health``, its *ready set* (``warmup_plan.py``: ``WarmupPlan.ready_forward``):

- the forward passes that *cover* every other (``programs.ForwardPrograms.cover``): the longest single-row prefill,
  the single-row decode step and the largest decode batch, so any batch runs, padded up or row by row, until its own
  shape is compiled;
- the samplers at one row and at the largest batch bucket (a batch between pads up to the largest,
  ``sampling.sampling_rows``), and the prompt-logprob programs;
- the page kernels a transfer runs: on a pool on one CPU device, a decode node's one-layer scatter of every page
  bucket, compiled ahead (a whole-pool scatter runs layer by layer on it, ``cpu_copy.scatter``); elsewhere the
  scatters and gathers of every page bucket, run into and out of free pages.

All of these but the page kernels are compiled ahead from shapes alone, side by side on ``COMPILE_THREADS`` threads,
while the weights still load (``warm_up``). Then a background thread (``compile_rest``) prepares the rest: the other
sampler buckets (run once on zeros), on a pool on one CPU device the whole-pool scatters, on a pool on one
accelerator with a zmq or tcp backend a handoff's copies between the device and the host as words, one a page bucket
(``kernels/host_words.py``; plain copies until then), the programs of several decode steps a dispatch
(``model/multi_step.py``, where the node runs more than one: every batch bucket at every page-table width; until one
is there its batch decodes a step at a time), and every other forward shape the
schedulers can form (``plan_for``: a prefill node's, a colocated node's and a decode node's recomputes, within their
chunked-prefill budgets; decode at every batch bucket up to ``max_running``), cheapest first, at a lower CPU
priority, each program once no request is in flight or ``IDLE_WAIT_S`` has passed. The scatters and forward passes
compile ahead of time: they touch no pool and run nothing.

Everything goes through JAX's persistent compile cache, so a restart loads instead of compiling (``docs/serving.md``
has the start-up times, cold and warm). ``--skip-server-warmup`` (SGLang's flag) skips it; the programs then compile
as requests need them. ``compiles.py`` counts what is compiled, by phase: ``serving`` must stay 0.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from fsm_pd.control.overlap import layer_group
from fsm_pd.kernels import cpu_copy, gather_pages, host_words, kv_hash, resolve_impl, scatter_layers, scatter_pages
from fsm_pd.kernels.placement import pool_placement
from fsm_pd.model import compile_demand, compiles, executables, sampling
from fsm_pd.model.decoder import LOGPROB_ROWS, MAX_TOP_LOGPROBS, next_token_logprobs
from fsm_pd.runtime.switch_interval import brief_turns
from fsm_pd.serving.startup import Startup
from fsm_pd.serving.warmup_plan import WarmupPlan, kind_of, plan_for

log = logging.getLogger(__name__)


# The ready set's programs compile this many at once. XLA's compile lets go of the interpreter's lock, so on a host of
# many cores (a TPU host has 13) they compile side by side; tracing and lowering hold the lock, one at a time. On 2
# cores, 2 (more threads only contend for the lock).
COMPILE_THREADS = max(1, min(8, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
                               else os.cpu_count() or 1))
def warm_up(engine, *, progress: bool = True, startup: Startup | None = None) -> dict:
    """Prepare the ready set of ``plan_for(engine)``; returns what it did and how long it took. Call before
    serving, then ``compile_rest`` for the other forward shapes.

    Every program of the ready set is lowered and compiled ahead from shapes alone (``jax.ShapeDtypeStruct``: no
    weight is read, so this runs while they load, ``model/meanwhile.py``), side by side on ``COMPILE_THREADS``
    threads: each forward shape's programs (its group of layers, head and embedding), the samplers at each ready
    batch bucket, the prompt-logprob programs; the page kernels run on the model thread meanwhile. XLA's compile
    lets go of the interpreter's lock, so the threads compile at once; from the compile cache they load at once."""
    compiles.install()
    plan = plan_for(engine)
    startup = startup or Startup()
    startup.steps(plan.steps)
    started, before = time.monotonic(), compiles.counts()["startup"]
    with _Bar(progress, plan.steps, f"preparing {engine.role} programs") as bar:
        def step(name: str, run) -> None:
            bar.describe(name)
            startup.step(name)
            began = time.monotonic()
            run()
            log.debug("warm-up: %s took %.2f s", name, time.monotonic() - began)
            bar.advance()
            startup.step(name, done=True)

        programs = engine.model.programs(engine.model_thread.pool)
        programs.covers = True  # what the ready set lacks runs on what it has, until ``compile_rest`` compiles it
        vocab = engine.model.config.vocab_size
        with ThreadPoolExecutor(COMPILE_THREADS, thread_name_prefix="warm-up-compile") as workers, \
                ThreadPoolExecutor(len(plan.ready_forward) + 3, thread_name_prefix="warm-up") as waiting:
            def side_by_side(kind: str):
                """Compile ``{name: thunk}`` on the workers, each thunk's programs counted as ``kind``."""
                def run(thunks: dict) -> dict:
                    futures = {name: workers.submit(_as_kind(kind, thunk)) for name, thunk in thunks.items()}
                    return {name: future.result() for name, future in futures.items()}
                return run

            def forward(shape: tuple[int, int]) -> None:
                step(f"forward {shape[0]}x{shape[1]}",
                     lambda: programs.compile(*shape, run=side_by_side(kind_of(shape))))

            def samplers() -> None:  # compiled for where the forward passes leave their logits
                sharding = side_by_side("decode")({"at": programs.logits_sharding})["at"]  # the head at one row
                for batch in plan.ready_samples:
                    step(f"sampling {batch}",
                         lambda batch=batch: side_by_side("sampling")(_sampler_thunks(batch, vocab, sharding)))
                    sampling.mark_prepared(batch)

            def logprobs() -> None:
                step("prompt logprobs", lambda: side_by_side("logprobs")(_logprob_thunks(engine.model, programs)))

            def kernels() -> None:
                if plan.scatter_buckets or plan.gather_buckets or plan.hash_buckets:
                    engine.model_thread.call(lambda owner: _run_kernels(owner, engine.layout, plan, step))

            # the longest prefill first: its programs take the longest to compile
            tasks = [*(lambda shape=shape: forward(shape) for shape in sorted(plan.ready_forward, reverse=True)),
                     samplers, logprobs, kernels]
            for future in [waiting.submit(task) for task in tasks]:
                future.result()  # a failure of any is the start-up's
    took = time.monotonic() - started
    report = {"seconds": round(took, 2), "programs": compiles.counts()["startup"] - before,
              "forward_shapes": len(plan.ready_forward), "background_shapes": len(plan.background_forward)}
    log.info("warm-up: ready after %d programs, compiled or loaded from the compile cache in %.1f s on %d threads "
             "(%d forward shapes; %d more compile in the background)", report["programs"], took, COMPILE_THREADS,
             report["forward_shapes"], report["background_shapes"])
    return report


def _as_kind(kind: str, thunk):
    """``thunk`` with the programs it loads counted as ``kind`` (``compiles.preparing`` is per thread)."""
    def run():
        with compiles.preparing(kind):
            return thunk()
    return run


IDLE_WAIT_S = 5.0  # the longest a background compile waits for the node to be idle before it starts anyway
# before the first one: a node that just turned ready is about to get the requests that waited for it
READY_GRACE_S = 1.0


def compile_rest(engine, *, busy: Callable[[], bool] = lambda: False, on_done=lambda report: None,
                 stop: threading.Event | None = None) -> threading.Thread:
    """Start a thread that prepares what ``warm_up`` left out, at a lower CPU priority than serving (on Linux a
    thread has its own nice value): the other sampler buckets, the whole-pool scatters (``cpu_copy.prepare_scatter``),
    a handoff's copies as words between an accelerator and the host (``host_word_jobs``) and the other forward
    shapes, cheapest first. No request waits on it: until a program is there, its work runs
    on one that covers it. Each program of the plan waits until ``busy()`` is False (at most ``IDLE_WAIT_S``):
    tracing holds the interpreter's lock, which a nice value does not share out, so it goes where requests are not.
    What requests ran without meanwhile (``compile_demand.py``) goes first and waits for nothing: its batches pay
    for the cover at every step. While it compiles, the interpreter's lock changes hands every 0.5 ms instead of 5,
    so the model thread gets it back soon after each device wait (``runtime/switch_interval.py``). ``on_done`` gets
    ``{"programs", "seconds", "demanded"}``. ``stop``, once set, ends the thread before its next program (without
    ``on_done``)."""
    stop = stop or threading.Event()
    plan = plan_for(engine)
    programs = engine.model.programs(engine.model_thread.pool)
    vocab = engine.model.config.vocab_size
    logits_sharding = programs.compile(*plan.ready_forward[0]).logits_sharding
    # shapes only: the pool itself belongs to the model thread
    pool = tuple(jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding) for a in engine.model_thread.pool)
    whole_scatters = plan.scatter_buckets if resolve_impl(engine.model_thread.pool) == "cpu" else []
    group = layer_group(engine.layout)
    # (kind, programs it makes, whether it is there already, how to make it), in the plan's order
    jobs = [("sampling", 4, partial(sampling.is_prepared, batch), partial(sampling.prepare, batch, vocab,
                                                                           logits_sharding))
            for batch in plan.background_samples]
    jobs += [("decode", 1, partial(_has, programs.steps, (batch, width, plan.steps_per_dispatch)),
              partial(programs.steps.compile, batch, width, plan.steps_per_dispatch))
             for batch, width in plan.step_loops]
    jobs += [("kernels", 1, lambda: False, partial(cpu_copy.prepare_scatter, pool, rows, layers))
             for rows in whole_scatters for layers in sorted({len(pool), group})]
    jobs += host_word_jobs(engine, plan, pool)
    jobs += [(kind_of(shape), 1, partial(_has, programs, shape), partial(programs.compile, *shape))
             for shape in plan.background_forward]

    def idle() -> bool:
        """Wait until the node is idle, at most ``IDLE_WAIT_S``: True; False at once when a request lacks a
        program."""
        until = time.monotonic() + IDLE_WAIT_S
        while busy() and time.monotonic() < until and not stop.is_set():
            if compile_demand.wait(0.02):
                return False
        return True

    def run() -> None:
        started, count, demanded = time.monotonic(), 0, 0

        def serve_demand() -> None:
            nonlocal count, demanded
            while not stop.is_set() and (wanted := compile_demand.take()) is not None:
                key, kind, what, compile_it = wanted
                began = time.monotonic()
                try:
                    with compiles.preparing(kind, background=True), brief_turns():
                        compile_it()
                except Exception:  # noqa: BLE001 - the cover goes on serving it (not tried again); the plan goes on
                    log.exception("background compile: %s, which requests ran without, failed to compile", what)
                    continue
                compile_demand.done(key)
                count, demanded = count + (4 if kind == "sampling" else 1), demanded + 1
                log.info("background compile: %s first, which requests ran without (%.1f s)", what,
                         time.monotonic() - began)

        _lower_priority()
        compile_demand.wait(READY_GRACE_S)
        for kind, made, there, make in jobs:
            serve_demand()
            while not stop.is_set() and not there() and not idle():
                serve_demand()  # a request lacked a program: that first, then wait for idle again
            if stop.is_set():
                return
            if not there():
                with compiles.preparing(kind, background=True), brief_turns():
                    make()
                count += made
        serve_demand()
        report = {"programs": count, "seconds": round(time.monotonic() - started, 2), "demanded": demanded}
        log.info("background compile: %d more programs in %.1f s (%d that requests ran without first); every "
                 "program this node runs is compiled", report["programs"], report["seconds"], demanded)
        on_done(report)

    thread = threading.Thread(target=run, name="background-compile", daemon=True)
    thread.start()
    return thread


def host_word_jobs(engine, plan: WarmupPlan, pool) -> list[tuple]:
    """``compile_rest``'s jobs for the programs that copy a handoff's staging array between the device and the host
    as 32-bit words (``kernels/host_words.py``), one a page bucket: a prefill node's to the host, a decode node's back.
    Only where the backend streams host bytes (zmq, tcp) and the pool is on one accelerator device; until a bucket's
    program is there, its handoffs copy the plain way."""
    backend = getattr(getattr(engine, "manager", None), "backend", None)
    sharding = pool[0].sharding
    if not getattr(backend, "progressive", False) or not host_words.pays_on(sharding) or not host_words.enabled():
        return []
    dtype = engine.layout.dtype
    jobs = []
    buckets = [(rows, True) for rows in plan.gather_buckets] + [(rows, False) for rows in plan.scatter_buckets]
    for rows, down in buckets:
        shape = engine.layout.staging_shape(rows)
        jobs.append(("kernels", 1, partial(host_words.is_prepared, shape, dtype, sharding, down=down, up=not down),
                     partial(host_words.prepare, shape, dtype, sharding, down=down, up=not down)))
    return jobs


def _has(programs, shape) -> bool:
    return shape in programs.shapes


def _lower_priority() -> None:
    with contextlib.suppress(AttributeError, OSError):  # not Linux: the thread competes at the node's priority
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 10)


def _sampler_thunks(batch: int, vocab: int, sharding) -> dict:
    """The four sampling programs at ``batch`` rows, each compiled ahead from shapes, or loaded as the executable an
    earlier start wrote (``executables.compiled``): the logits placed where the forward passes leave them, the other
    inputs host arrays, as ``sampling.sample`` passes them; ``sampling.sample`` runs them from then on
    (``sampling.hold``)."""
    def spec(shape, dtype, placed=None):
        return jax.ShapeDtypeStruct(shape, dtype, sharding=placed)

    logits = spec((batch, vocab), jnp.float32, sharding)
    rows = lambda dtype: spec((batch,), dtype)  # noqa: E731
    table = spec((batch, vocab), jnp.float32)

    def held(jitted, *args):
        def prepare():
            program = executables.compiled(jitted, logits, *args)
            sampling.hold(jitted.__name__, batch, sharding, program)
            return program
        return prepare

    return {
        "greedy": held(sampling.greedy_tokens),
        "sample": held(sampling.sample_tokens, spec((batch, sampling.ROW_PARAMS), jnp.int32)),
        "adjust": held(sampling.adjust_logits, table, rows(jnp.float32), rows(jnp.float32), rows(jnp.float32), table),
        "mask": held(sampling.mask_logits, spec((batch, (vocab + 31) // 32), jnp.int32)),
    }


def _logprob_thunks(model, programs) -> dict:
    """The prompt-logprob programs (one per ``top_k``): compiled ahead from shapes; on a split model, run once on
    zeros (its weights are in: a split model loads whole)."""
    rows = np.zeros((LOGPROB_ROWS, model.config.hidden_size), np.float32)
    ids = np.zeros(LOGPROB_ROWS, np.int32)

    def prepare(top_k: int):
        if model.tp is None:  # ahead, without running it (top-k over the vocabulary costs a second on CPU)
            return programs.compile_logprobs(top_k)
        return next_token_logprobs(model.params, rows, ids, config=model.config, top_k=top_k)[0].block_until_ready()

    top_ks = (0, min(MAX_TOP_LOGPROBS, model.config.vocab_size))
    return {top_k: (lambda top_k=top_k: prepare(top_k)) for top_k in top_ks}


def _run_kernels(owner, layout, plan: WarmupPlan, step) -> None:
    """On the model thread of an idle node: copy zeros into, and out of, free pages at every page bucket (a page
    that is free holds nothing anyone reads, and the first request to take it overwrites what it reads)."""
    usable = layout.num_pages - 1
    group = layer_group(layout)
    placement = pool_placement(owner.pool)  # a split pool's transfers land split like it (control/jax_kv.py)
    device = next(iter(owner.pool[0].sharding.device_set))
    def scatter(rows: int) -> None:
        if resolve_impl(owner.pool) == "cpu":  # layer by layer: the whole-pool programs compile in the background
            cpu_copy.prepare_scatter(owner.pool, rows, 1)
            return
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

    def gather(rows: int) -> None:
        if resolve_impl(owner.pool) != "cpu":  # the CPU gather is NumPy's: nothing to compile
            gather_pages(owner.pool, list(range(1, min(rows, usable) + 1)), layout=layout).block_until_ready()

    def hash_pages(rows: int) -> None:  # the parts of a handoff between pools split alike: each shard's slots whole
        per_shard = layout.slots // layout.tp
        kv_hash.device_checksums(owner.pool, list(range(1, min(rows, usable) + 1)),
                                 [(shard, 0, per_shard) for shard in range(layout.tp)], layout.head_dim)

    with compiles.preparing("kernels"):  # on the model thread: the kind is set where the programs compile
        for rows in plan.scatter_buckets:
            step(f"scatter {rows} pages", lambda rows=rows: scatter(rows))
        for rows in plan.gather_buckets:
            step(f"gather {rows} pages", lambda rows=rows: gather(rows))
        for rows in plan.hash_buckets:
            step(f"hash {rows} pages", lambda rows=rows: hash_pages(rows))


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
