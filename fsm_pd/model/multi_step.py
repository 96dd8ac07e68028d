"""Several decode steps in one program: the model, sampling and the stop checks run in a loop on the device.

A decode step the host drives costs more than the model: its inputs go over, its logits are sampled, the tokens come
back and feed the next step's inputs (on a TPU v5e a SmolLM2 step of 1.2 ms on the device took 2.7 ms through the
node's call, ``docs/tpu.md``). ``decode_steps`` runs up to ``steps`` decode steps of a batch in one dispatch: each
step's inputs are the last step's tokens, patched on the device, and each row's tokens are sampled there
(``sampling.sample_row``, the host sampler's own function, so a row draws what it would draw a step at a time). A row
stops when it samples one of its stop tokens or has used its ``budget`` of tokens (what its ``max_new_tokens``, the
context and the pages reserved for it allow); from then on it writes nothing and stays where it is, and the loop ends
when every row has stopped. The pool is donated and written in place, as in a single step.

A dispatch's inputs travel as one int32 array (``pack``): per row its last token, position, budget, seed, sampling
step, top-k, temperature, top-p and min-p (their float bits), the steps to run, its stop tokens and its page table,
only as wide as the batch needs (``StepPrograms.width_for``: a few widths, each a program). What comes back is one
``[B, max_steps]`` int32 array, -1 after a row stopped.

What the host must do itself (penalties, grammar masks, logprobs, stop strings) is not here: a batch with a request
that needs it decodes a step at a time (``serving/decode_loop.py``), and a stop string matched mid-loop ends its
request on the host, which drops the tokens after it.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

from fsm_pd.kernels.pool_format import PoolJit
from fsm_pd.model import compile_demand, executables
from fsm_pd.model.attention import block_pages
from fsm_pd.model.config import ModelConfig
from fsm_pd.model.decoder import embed_tokens, final_logits, forward_group, top_params
from fsm_pd.model.input_buckets import batch_bucket
from fsm_pd.model.sampling import sample_row

MAX_STOP_IDS = 8  # stop tokens a row carries on the device (EOS and stop_token_ids); more: the host checks them
# the packed columns before a row's stop tokens and page table
TOKEN, POSITION, BUDGET, SEED, STEP, TOP_K, TEMPERATURE, TOP_P, MIN_P, STEPS = range(10)
HEAD = 10


@dataclass(frozen=True, slots=True)
class StepRow:
    """One row's inputs: its last token goes to ``position``; at most ``budget`` tokens are generated."""

    token: int
    position: int
    budget: int
    pages: list[int]
    seed: int = 0  # the request's resolved seed (its low 32 bits are used, as on the host)
    step: int = 0  # the sampling step of its first token here: tokens the request generated before
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0  # 0 keeps all
    min_p: float = 0.0
    stop_ids: tuple[int, ...] = ()


def pack(rows: list[StepRow], batch: int, width: int, steps: int, vocab: int) -> np.ndarray:
    """The dispatch's one host array ``[batch, HEAD + MAX_STOP_IDS + width]``; rows past ``len(rows)`` are padding
    (budget 0: stopped before the first step, writing only the pad page)."""
    out = np.zeros((batch, HEAD + MAX_STOP_IDS + width), np.int32)
    out[:, HEAD:HEAD + MAX_STOP_IDS] = -1
    out[:, STEPS] = steps
    bits = lambda values: np.asarray(values, np.float32).view(np.int32)  # noqa: E731
    n = len(rows)
    if not n:
        return out
    out[:n, TOKEN] = [r.token for r in rows]
    out[:n, POSITION] = [r.position for r in rows]
    out[:n, BUDGET] = [r.budget for r in rows]
    out[:n, SEED] = np.asarray([r.seed & 0xFFFFFFFF for r in rows], np.uint32).view(np.int32)
    out[:n, STEP] = [r.step for r in rows]
    out[:n, TOP_K] = [r.top_k if r.top_k < vocab else 0 for r in rows]  # >= the vocabulary: keep all
    out[:n, TEMPERATURE] = bits([r.temperature for r in rows])
    out[:n, TOP_P] = bits([r.top_p for r in rows])
    out[:n, MIN_P] = bits([r.min_p for r in rows])
    for i, row in enumerate(rows):
        if len(row.stop_ids) > MAX_STOP_IDS:
            raise ValueError(f"{len(row.stop_ids)} stop tokens; the device checks at most {MAX_STOP_IDS}")
        if len(row.pages) > width:
            raise ValueError(f"a row of {len(row.pages)} pages does not fit a table {width} wide")
        out[i, HEAD:HEAD + len(row.stop_ids)] = row.stop_ids
        out[i, HEAD + MAX_STOP_IDS:HEAD + MAX_STOP_IDS + len(row.pages)] = row.pages
    return out


def decode_steps(params, pool, packed, *, config: ModelConfig, kernels: str, max_steps: int):
    """Up to ``min(packed[0, STEPS], max_steps)`` decode steps of every row of ``packed`` (``pack``); returns each
    row's tokens ``[B, max_steps]`` (-1 once it stopped) and the pool."""
    floats = lambda column: jax.lax.bitcast_convert_type(packed[:, column], jnp.float32)  # noqa: E731
    stops = packed[:, HEAD:HEAD + MAX_STOP_IDS]
    tables = packed[:, HEAD + MAX_STOP_IDS:]
    seeds = jax.lax.bitcast_convert_type(packed[:, SEED], jnp.uint32)
    temperature, top_p, min_p, top_k = floats(TEMPERATURE), floats(TOP_P), floats(MIN_P), packed[:, TOP_K]
    first_step = packed[:, STEP]
    steps = jnp.minimum(packed[0, STEPS], max_steps)
    greedy = jnp.all(temperature <= 0)
    top = top_params(params)

    def sample(logits, i):
        drawn = lambda x: jax.vmap(sample_row)(x, temperature, top_p, top_k, min_p, seeds, first_step + i)  # noqa: E731
        return jax.lax.cond(greedy, lambda x: jnp.argmax(x, axis=-1).astype(jnp.int32), drawn, logits)

    def running(carry):
        i, done = carry[0], carry[5]
        return (i < steps) & jnp.logical_not(jnp.all(done))

    def step(carry):
        i, pool, tokens, positions, budget, done, out = carry
        active = jnp.logical_not(done)
        lengths = active.astype(jnp.int32)  # a stopped row writes only the pad page, as a padding row does
        x = embed_tokens(params["embed"], tokens[:, None])
        x, pool = forward_group(params["layers"], pool, x, positions, lengths, tables, config=config,
                                kernels=kernels)
        logits, _ = final_logits(top, x, lengths, config=config)
        new = sample(logits, i)
        out = out.at[:, i].set(jnp.where(active, new, -1))
        budget = budget - lengths
        stopped = jnp.any(new[:, None] == stops, axis=1) | (budget <= 0)
        return (i + 1, pool, jnp.where(active, new, tokens), positions + lengths, budget, done | (active & stopped),
                out)

    budget = packed[:, BUDGET]
    start = (jnp.int32(0), tuple(pool), packed[:, TOKEN], packed[:, POSITION], budget, budget <= 0,
             jnp.full((packed.shape[0], max_steps), -1, jnp.int32))
    _, pool, *_, out = jax.lax.while_loop(running, step, start)
    return out, pool


# the pool's results row-major, as it comes in (``kernels/pool_format.py``)
_decode_steps = PoolJit(decode_steps, pool="pool", results=lambda pool: (None, pool),
                        static_argnames=("config", "kernels", "max_steps"), donate_argnames=("pool",))


def table_widths(full: int, page_size: int) -> list[int]:
    """The page-table widths a dispatch can take: whole attention blocks, 4x apart, up to the pool's ``full`` width
    (few programs; a table at most 4x wider than it needs, which costs only its bytes on the way over)."""
    widths, width = [], block_pages(page_size)
    while width < full:
        widths.append(width)
        width *= 4
    return [*widths, full]


class StepPrograms:
    """``decode_steps`` compiled for one model and one pool, by (batch, table width, max_steps). Thread-safe, like
    ``ForwardPrograms``: a node compiles ahead on its start-up or background thread and calls on the model thread."""

    def __init__(self, config: ModelConfig, params, pool, full_width: int, kernels: str, inputs):
        self.config, self.kernels, self.inputs = config, kernels, inputs
        self._params, self._pool = params, pool  # shapes only (``jax.ShapeDtypeStruct``)
        # The TPU kernel fetches only the pages below a row's length, so a wider table costs its bytes on the way
        # over and no device time: one width there. Each width was a program per batch bucket, and on a v5e each of
        # SmolLM2's took ~15 s to compile: 5 widths x 7 buckets kept a node compiling for minutes under load (r11).
        # The jnp path gathers whole blocks up to the table's width: there the narrow tables pay.
        self.widths = table_widths(full_width, pool[0].shape[1]) if kernels == "jnp" else [full_width]
        self._programs: dict[tuple[int, int, int], jax.stages.Compiled] = {}
        self._lock = threading.Lock()

    @property
    def shapes(self) -> set[tuple[int, int, int]]:
        return set(self._programs)

    def batch_for(self, rows: int, most: int) -> int:
        """The batch a dispatch of ``rows`` runs at, of a node that runs ``most`` at once: the next power of two on
        jnp; on the TPU kernels the next power of four (and ``most``'s bucket at the top). There a padding row costs
        next to nothing (the matmuls' time is the weights', the kernel skips a row of no context), and each bucket
        is a program of ~15 s to compile on a v5e: 1, 4, 16, 64 instead of 1, 2, 4, ..., 64."""
        bucket = batch_bucket(rows)
        if self.kernels == "jnp":
            return bucket
        exponent = bucket.bit_length() - 1  # bucket = 2 ** exponent
        return min(batch_bucket(most), 4 ** ((exponent + 1) // 2))

    def batches(self, most: int) -> list[int]:
        """Every batch ``batch_for`` gives for up to ``most`` rows."""
        return sorted({self.batch_for(rows, most) for rows in range(1, batch_bucket(most) + 1)})

    def width_for(self, pages: int) -> int:
        """The narrowest width that holds ``pages`` columns."""
        return next((w for w in self.widths if w >= pages), self.widths[-1])

    def compile(self, batch: int, width: int, max_steps: int) -> jax.stages.Compiled:
        key = (batch, width, max_steps)
        with self._lock:
            program = self._programs.get(key)
        if program is not None:
            return program
        packed = jax.ShapeDtypeStruct((batch, HEAD + MAX_STOP_IDS + width), jnp.int32, sharding=self.inputs)
        program = executables.compiled(_decode_steps, self._params, self._pool, packed, config=self.config,
                                       kernels=self.kernels, max_steps=max_steps)
        with self._lock:
            return self._programs.setdefault(key, program)

    def find(self, batch: int, width: int, max_steps: int, *, compile_missing: bool) -> tuple[int, int] | None:
        """The (batch, width) to run a dispatch of ``batch`` rows and ``width`` columns on: its own, else the
        narrowest compiled one of that batch that is wider; None when none is and ``compile_missing`` is False (the
        caller decodes a step at a time meanwhile, on programs that cover any shape, and the background compile takes
        this shape before its plan: ``compile_demand.py``)."""
        with self._lock:
            wider = sorted(w for b, w, k in self._programs if b == batch and k == max_steps and w >= width)
        if wider:
            return batch, wider[0]
        if not compile_missing:  # the background compiles it next, after what a step at a time runs on
            compile_demand.want((self, batch, width, max_steps), "decode",
                                f"{max_steps} steps, {batch} rows, {width} pages wide",
                                lambda: self.compile(batch, width, max_steps), compile_demand.LOOP)
            return None
        self.compile(batch, width, max_steps)
        return batch, width

    def run(self, params, pool, packed: np.ndarray, max_steps: int):
        """Run the compiled program for ``packed``'s shape: ``(tokens [B, max_steps], pool)``."""
        batch, columns = packed.shape
        program = self.compile(batch, columns - HEAD - MAX_STOP_IDS, max_steps)
        return program(params, tuple(pool), jax.device_put(packed, self.inputs))

