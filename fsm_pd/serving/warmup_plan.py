"""What a node's warm-up prepares (``WarmupPlan``, ``plan_for``): the ready set, which covers every shape a request
can form, and the rest, which ``warmup.compile_rest`` prepares in the background, from the limits the engine's
schedulers batch by. Engines that share one pool (``--role pd``) plan one set of sampler buckets between them
(``sample_batches``)."""

from __future__ import annotations

from dataclasses import dataclass, field

from fsm_pd.kernels import bucket_sizes, kv_hash
from fsm_pd.kvpool.pages import pages_for
from fsm_pd.model import input_buckets
from fsm_pd.model.forward_shapes import decode_shapes, prefill_shapes

SHORT_PROMPT_TOKENS = 64  # a first chat turn's prompt: its prefill is in every node's ready set


@dataclass
class WarmupPlan:
    """What one node compiles: forward shapes, sampler batch buckets, and page buckets of its transfer kernels."""

    forward: list[tuple[int, int]]
    sample_batches: list[int]
    scatter_buckets: list[int] = field(default_factory=list)  # a decode node's
    gather_buckets: list[int] = field(default_factory=list)  # a prefill node's
    hash_buckets: list[int] = field(default_factory=list)  # a node whose KV checksum is the device hash
    short_prompt: int = 0  # the single-row prefill of this many tokens too (0: none)
    # several decode steps a dispatch: (batch bucket, page-table width) of each program, and the steps it holds
    step_loops: list[tuple[int, int]] = field(default_factory=list)
    steps_per_dispatch: int = 1

    @property
    def ready_forward(self) -> list[tuple[int, int]]:
        """The forward shapes that cover every other one (``ForwardPrograms.cover``): the single-row decode step, the
        largest decode batch and the longest single-row prefill. A prefill step of any batch runs row by row on the
        latter, a decode batch row by row on the single row or padded up to the largest (whichever ``call_cost``
        says is cheaper: a 16-row batch as one call of 64 rows, not 16 calls; on the chip 16 single-row calls made
        a 36 ms TPOT), until the background compile reaches their own shapes. And the single-row prefill of a short
        prompt (``SHORT_PROMPT_TOKENS``): every node prefills those, a decode node the ones the router serves whole
        on it (``--pd-policy auto``, the default); a chat turn's prompt padded to the longest would cost 0.8 s (SmolLM2,
        512 tokens) instead of 0.1 s."""
        decode = [shape for shape in self.forward if shape[1] == 1]
        prefill = [shape for shape in self.forward if shape[1] > 1 and shape[0] == 1]
        short = [shape for shape in prefill if shape[1] == input_buckets.token_bucket(self.short_prompt)]
        return sorted({*decode[:1], *decode[-1:], *([max(prefill)] if prefill else []),
                       *(short if self.short_prompt else [])})

    @property
    def background_forward(self) -> list[tuple[int, int]]:
        """The other forward shapes, cheapest first: the small batches and short prompts most requests form."""
        ready = set(self.ready_forward)
        return sorted((shape for shape in self.forward if shape not in ready), key=lambda s: (s[0] * s[1], s[1]))

    @property
    def ready_samples(self) -> list[int]:
        """Sampler batch buckets prepared before ready: one row (most steps of a lightly loaded node) and the
        largest, which every other pads up to (``sampling.sampling_rows``) until the background prepares it."""
        return sorted({self.sample_batches[0], self.sample_batches[-1]})

    @property
    def background_samples(self) -> list[int]:
        return [b for b in self.sample_batches if b not in self.ready_samples]

    @property
    def steps(self) -> int:
        """Steps before the node is ready."""
        return (len(self.ready_forward) + len(self.ready_samples) + 1 + len(self.scatter_buckets)
                + len(self.gather_buckets) + len(self.hash_buckets))


def plan_for(engine) -> WarmupPlan:
    """The plan of a prefill, decode or colocated engine, from the limits its schedulers batch by."""
    max_prompt = engine.max_context - 1
    prompt_buckets = bucket_sizes(pages_for(max_prompt, engine.page_size))
    # both sides of a handoff hash the room's pages (kernels/kv_hash.py) where the pool is on an accelerator
    hash_buckets = prompt_buckets if _hashes_on_device(engine) else []
    if engine.role == "prefill" and not getattr(engine, "serves_local", False):
        return WarmupPlan(prefill_shapes(engine.max_prefill_batch, engine.chunked_prefill_size),
                          sample_batches(engine),
                          gather_buckets=prompt_buckets if _copies_pages(engine) else [],
                          hash_buckets=hash_buckets, short_prompt=SHORT_PROMPT_TOKENS)
    # prefills here: a colocated node's prompts, and both nodes' recomputes (retracted requests, failed transfers)
    limits = [(engine.loop.max_recompute_batch, engine.loop.max_recompute_tokens)]
    if engine.role in ("colocated", "prefill"):  # a prefill node that serves requests whole (--serve-local) too
        limits.append((engine.max_prefill_batch, engine.chunked_prefill_size))
    if engine.role != "colocated":
        limits.append((engine.recompute.max_batch, engine.recompute.max_tokens))
    forward = {shape for batch, tokens in limits for shape in prefill_shapes(batch, tokens)}
    forward |= set(decode_shapes(engine.max_running))
    plan = WarmupPlan(sorted(forward), sample_batches(engine),
                      hash_buckets=hash_buckets, short_prompt=SHORT_PROMPT_TOKENS)
    loops = engine.model.programs(engine.model_thread.pool).steps
    if engine.loop.steps_per_dispatch > 1 and loops is not None:
        plan.steps_per_dispatch = engine.loop.steps_per_dispatch
        plan.step_loops = [(batch, width) for batch in loops.batches(engine.max_running) for width in loops.widths]
    if _copies_pages(engine) and engine.role == "decode":
        plan.scatter_buckets = prompt_buckets
    if _copies_pages(engine) and engine.role == "prefill":
        plan.gather_buckets = prompt_buckets
    return plan


def sample_batches(engine) -> list[int]:
    """The sampler's batch buckets of ``engine``: every power of two up to the most rows it samples at once. Engines
    that share a pool (``--role pd``) share one set, the largest either needs: the samplers are the same programs for
    both, so a prefill engine's batch of 8 pads up to the decode engine's 64 until the background compiles 8, and the
    process compiles the samplers a colocated node does (on the chip, 12 sampler programs before ready had taken 25 s
    of compile against a colocated node's 8 and 15 s)."""
    shared = getattr(engine, "shared", None)
    engines = (shared.engines() if shared is not None else None) or [engine]
    return _powers(max(_most_sampled_rows(e) for e in engines))


def _most_sampled_rows(engine) -> int:
    if engine.role == "prefill" and not getattr(engine, "serves_local", False):
        return engine.max_prefill_batch
    limits = [engine.loop.max_recompute_batch, engine.max_running]
    if engine.role in ("colocated", "prefill"):
        limits.append(engine.max_prefill_batch)
    if engine.role != "colocated":
        limits.append(engine.recompute.max_batch)
    return max(limits)


def _copies_pages(engine) -> bool:
    """Whether this PD node's handoffs copy pages (every backend but ``pool``, which hands ownership over)."""
    manager = getattr(engine, "manager", None)
    return manager is None or manager.backend.name != "pool"


def _hashes_on_device(engine) -> bool:
    """Whether this PD node checksums its handoffs with the device hash (its pool on an accelerator, or
    ``FSM_PD_KV_CHECKSUM_ALGORITHM``): a program per page bucket, which must not compile on a request's path."""
    effects = getattr(getattr(engine, "manager", None), "effects", None)
    return bool(effects is not None and effects.kv_checksum and effects.kv.checksum_algorithm == kv_hash.ALGORITHM)


def _powers(limit: int) -> list[int]:
    return sorted({b for b, _ in decode_shapes(limit)})


def kind_of(shape: tuple[int, int]) -> str:
    return "decode" if shape[1] == 1 else "prefill"
