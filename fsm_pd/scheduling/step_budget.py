"""How many prompt tokens a prefill step may take while streams are decoding: a bound in time, not only in tokens.

A colocated node runs each step as a prefill chunk, then one decode step for every running stream, so a running
stream waits for the whole chunk before its next token. ``--chunked-prefill-size`` bounds a chunk in padded tokens
(512): on two CPU cores that is ~0.8 s of SmolLM2, and a 480-token prompt joining stalled every running stream for
that long (2 s on a loaded machine; issue 34, ``docs/crossover.md``, "Why a token costs more under load"). Tokens
are the wrong unit for a stall: what a chunk costs depends on the hardware, the model and the load.

``StepBudget`` learns, as the node serves, what a prefill step costs per padded size (batch bucket x token bucket,
the shape that selects the program) and what a decode step costs, and while any stream decodes it cuts the step's
budget to the largest power-of-two token count whose expected cost is at most ``chunk_steps`` decode steps. A
joining prompt then delays a running stream's next token by about ``1 + chunk_steps`` decode steps per chunk,
instead of by its whole prefill; the prompt's own first token comes later, as its chunks now interleave with decode
steps (smaller chunks also cost more per token: on SmolLM2 a 64-token chunk 1.6 ms a token, a 512-token one 1.55,
a 16-token one 4). With no stream decoding the budget is the token budget, as before: nothing waits on a chunk.

Rules it keeps:

- The budget is a power of two between ``MIN_TOKEN_BUCKET`` (a step always makes progress) and the token budget, so
  every shape a step forms with it is one the warm-up compiles for the token budget (``forward_shapes.prefill_shapes``):
  no request waits on a compile.
- It never cuts below the *floor*: the size up to which doubling a chunk costs less than ``DOUBLING_COST`` times as
  much. Below it a step is bound by reading the weights, not by its tokens (SmolLM2 on 2 cores: 16 tokens 64 ms,
  32 86 ms, 64 105 ms, 128 173 ms: the floor is 64), so a smaller chunk would spare the streams little and multiply
  the prompt's steps.
- A cost is the least of the last ``WINDOW`` times a size took: other processes on the machine only ever add to a
  step, and one slow step must not shrink every later chunk. A decode step's cost is taken the same way, so both
  follow the machine's load within a few steps. A prefill size's first step is not counted at all: the first run
  of a compiled program pays a one-time set-up (~150 ms here), and a size known only by it looked twice as dear
  as it is (on a fresh node, a 480-token prompt beside one stream went in 16-token chunks, 30 of them).
- Until a decode step has been seen, or a prefill cost at all, it cannot know: it allows the smallest chunk, which
  teaches it a first cost at little harm to the streams. (On a colocated node the first prompt prefills with
  nothing decoding, at the token budget, so it has a cost by the time a second prompt joins.)
- A size seen only a few times (fewer than ``TRUSTED_SAMPLES``) is taken to cost at most what the next smaller size
  seen costs, in proportion to its tokens. Its few samples may all come from one bad moment, and while streams decode
  it is not run again to correct them: on ``--role pd`` (CPU, tiny model) the 512-token size kept the 42.6 ms of one
  step taken under contention while 256 tokens cost 6.3, and the rule, beside streams of 3.4 ms steps, then took two
  68-token prompts a step out of sixteen waiting (its time to first token 3-4x a colocated node's, where 512 tokens
  cost 6.8 ms). With the cap the size is run again and its own samples decide once there are enough of them.
- The expected cost of a size never seen is read off the line between the two nearest sizes seen, or in proportion
  to the nearest (below the smallest). Above the largest seen it cannot be estimated (at small sizes the cost is
  mostly fixed, so any line through them overestimates, and the rule would stay at the smallest chunk for good): the
  next size up is *tried once* when twice the largest seen's cost is within ``TRY_SLACK`` (1.5) times the bound. A
  chunk twice as large costs at most twice as much, so that step exceeds the bound by at most half, once per size:
  from then on its cost is known. (Trying it whenever the largest seen fits was tried first: on a loaded machine its
  first 128-token chunk beside one stream cost 395 ms against a 120 ms bound.)

Jax-free and clock-free: the scheduler reports durations it measured (its clock is a port), so unit tests and the
simulation can drive it with scripted costs.
"""

from __future__ import annotations

from collections import deque

from fsm_pd.model.input_buckets import MIN_TOKEN_BUCKET, token_bucket

# How many decode steps' time one prefill chunk may take while streams decode (--prefill-chunk-steps). A running
# stream's gap is then at most about (1 + this) decode steps. 4 lets SmolLM2 on 2 cores prefill 64-token chunks
# beside one stream (a 30 ms decode step; a 64-token chunk ~105 ms) and 128-token chunks beside eight (72 ms):
# gaps of ~0.14 s and ~0.25 s instead of 0.8 s, for a 480-token prompt's first token ~1.1 s instead of ~0.8 s.
DEFAULT_CHUNK_STEPS = 4.0
WINDOW = 8  # a cost is the least of the last this many times taken
DOUBLING_COST = 1.5  # the floor: the largest size whose double cost less than this many times as much
# A size above every size seen is tried once when twice the largest seen's cost is within this many allowances. A
# chunk twice the size costs at most twice as much, so that one step exceeds the bound by at most half.
TRY_SLACK = 1.5
# A size seen fewer times than this costs at most in proportion to the next smaller size seen (``prefill_seconds``).
TRUSTED_SAMPLES = 4


class StepBudget:
    def __init__(self, token_budget: int, chunk_steps: float = DEFAULT_CHUNK_STEPS):
        if chunk_steps < 0:
            raise ValueError(f"chunk_steps must be >= 0 (0 turns the time bound off), got {chunk_steps}")
        self.token_budget = token_budget
        self.chunk_steps = chunk_steps
        self._prefill: dict[int, deque[float]] = {}  # padded tokens of a step -> its last WINDOW durations
        self._decode: deque[float] = deque(maxlen=WINDOW)  # a first run is outweighed by the window's least
        self._first_runs: set[int] = set()  # prefill sizes run once: their next run is their first cost
        self.cut_steps = 0  # prefill steps run on a budget the time bound cut (the scheduler counts them)

    @property
    def enabled(self) -> bool:
        return self.chunk_steps > 0

    def observe_prefill(self, padded_tokens: int, seconds: float) -> None:
        """A prefill step of ``padded_tokens`` (batch bucket x token bucket) took ``seconds``. A size's first step
        is not counted: XLA's CPU runtime sets a compiled program up on its first run (SmolLM2 here: 250 ms for a
        32-token prefill that then takes 89, 179 ms for a batch-2 decode step that then takes 42), so that time
        says nothing about the next step of that size."""
        if padded_tokens not in self._first_runs:
            self._first_runs.add(padded_tokens)
            return
        self._prefill.setdefault(padded_tokens, deque(maxlen=WINDOW)).append(seconds)

    def observe_decode(self, seconds: float) -> None:
        """A decode step of the running streams took ``seconds``."""
        self._decode.append(seconds)

    @property
    def prefill_seconds(self) -> dict[int, float]:
        """The cost of each padded size seen; a size seen fewer than ``TRUSTED_SAMPLES`` times costs at most the
        next smaller size's cost in proportion to its tokens."""
        costs: dict[int, float] = {}
        smaller = None
        for tokens, times in sorted(self._prefill.items()):
            cost = min(times)
            if smaller is not None and len(times) < TRUSTED_SAMPLES:
                cost = min(cost, costs[smaller] * tokens / smaller)
            costs[tokens], smaller = cost, tokens
        return costs

    @property
    def decode_seconds(self) -> float | None:
        return min(self._decode) if self._decode else None

    def expected(self, padded_tokens: int) -> float | None:
        """The expected cost of a prefill step of ``padded_tokens``: its own when seen, else on the line between the
        nearest sizes seen, or in proportion to the nearest; None before any prefill was seen."""
        costs = self.prefill_seconds
        if not costs:
            return None
        if padded_tokens in costs:
            return costs[padded_tokens]
        below = [(t, s) for t, s in costs.items() if t < padded_tokens]
        above = [(t, s) for t, s in costs.items() if t > padded_tokens]
        if below and above:
            (t0, s0), (t1, s1) = below[-1], above[0]
            return s0 + (s1 - s0) * (padded_tokens - t0) / (t1 - t0)
        t0, s0 = below[-1] if below else above[0]
        return s0 * padded_tokens / t0

    def tokens(self, decoding: bool) -> int:
        """This step's prefill budget in padded tokens: the token budget, cut while ``decoding`` to what costs at
        most ``chunk_steps`` decode steps (a power of two, at least the floor)."""
        if not decoding or not self.enabled:
            return self.token_budget
        decode = self.decode_seconds
        if decode is None or not self._prefill:
            return min(MIN_TOKEN_BUCKET, self.token_budget)
        allowed = self.chunk_steps * decode
        limit = token_bucket(self.token_budget)
        largest = max(self._prefill)
        size = self.floor()
        while size * 2 <= limit:
            if size * 2 > largest:  # never seen: tried once, when twice the largest seen is within the slack
                if size >= largest and 2 * self.expected(largest) <= TRY_SLACK * allowed:
                    size *= 2
                break
            if self.expected(size * 2) > allowed:
                break
            size *= 2
        return min(size, self.token_budget)

    def floor(self) -> int:
        """The size below which a cut saves little time: from it, doubling a chunk costs ``DOUBLING_COST`` times as
        much or more (sizes seen only)."""
        costs = self.prefill_seconds
        size = MIN_TOKEN_BUCKET
        while size in costs and size * 2 in costs and costs[size * 2] < DOUBLING_COST * costs[size]:
            size *= 2
        return size

    def state(self) -> dict:
        """What the rule knows now, for ``/server_info`` (``prefill_budget``): the decode step's cost, each padded
        size's expected cost and how many times it was timed, and the prefill steps cut."""
        decode = self.decode_seconds
        return {"chunk_steps": self.chunk_steps, "decode_ms": None if decode is None else round(decode * 1000, 3),
                "prefill_ms": {str(t): round(s * 1000, 3) for t, s in self.prefill_seconds.items()},
                "prefill_samples": {str(t): len(times) for t, times in sorted(self._prefill.items())},
                "cut_steps": self.cut_steps}

    def describe(self) -> str:
        if not self.enabled:
            return f"prefill steps bounded by {self.token_budget} padded tokens only"
        costs = ", ".join(f"{t}: {s * 1000:.0f} ms" for t, s in sorted(self.prefill_seconds.items()))
        decode = "unknown" if self.decode_seconds is None else f"{self.decode_seconds * 1000:.1f} ms"
        return (f"while streams decode, a prefill step costs at most {self.chunk_steps:g} decode steps (one: "
                f"{decode}); prefill steps seen by padded tokens: {costs or 'none'}; {self.cut_steps} steps cut")
