"""The decode engine's loop as far as pages go: every decoding request grows a page every ``page_size`` tokens, and
when the pool cannot grow them all the newest are retracted (pages given back) and resumed later (KV recomputed).

What runs is production code where it can be without jax: the retraction policy ``serving.retraction.
pick_retractions`` (which requests give their pages back), the real ``PageAllocator``'s ``extend`` and
``give_back`` (recorded: ``allocator.RecordingAllocator``), ``page_admission.admits`` (a resume waits for its pages
with headroom to spare), ``PrefixCache.unlock`` of a retracted request's cached prefix and
``Preallocation.finished``.
``serving/decode_loop.py`` itself imports jax (the forward pass, sampling), so the step around these calls is
mirrored here from ``DecodeLoop.step`` (``_resume`` then ``_with_pages``, ``_retract``), not imported: a change to
that loop's order is not seen by the simulation.

Pages are checked as everywhere else: a decode step writes its position's page (it must be the request's), a
recompute writes every page of a resumed request (a writer until it is done), and a retraction's ``give_back``
is a page going back to the free list (no writer or reader may be left on it).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from fsm_pd.kvpool.pages import OutOfPages, pages_for
from fsm_pd.kvpool.prefix_cache import NO_MATCH
from fsm_pd.scheduling.page_admission import admits
from fsm_pd.serving.retraction import pick_retractions

if TYPE_CHECKING:
    from fsm_pd.sim.engine_schedulers import DecodeScheduler, SimRequest

STEP_S = 0.002  # one batched decode step
RECOMPUTE_TOKEN_S = 1e-6


class SimDecodeLoop:
    def __init__(self, scheduler: DecodeScheduler):
        self.s = scheduler
        self.running: list[SimRequest] = []
        self.retracted: list[SimRequest] = []  # oldest first
        self.recomputing = 0
        self.arrivals = 0
        self.preempted = self.resumed = 0
        self._stepping = False

    def __len__(self) -> int:
        return len(self.running) + len(self.retracted) + self.recomputing

    @property
    def resuming(self) -> bool:
        """Retracted requests wait for pages: the engine admits nothing new until they are back."""
        return bool(self.retracted)

    def add(self, seq: SimRequest, tokens: int, pages: list[int]) -> None:
        """A request whose handoff succeeded decodes ``tokens`` tokens from its room's ``pages`` (model thread)."""
        seq.pages = pages
        seq.meta.update(order=self.arrivals, generated=0, target=tokens)
        self.arrivals += 1
        self.running.append(seq)
        self._kick()

    def _kick(self) -> None:
        if not self._stepping:
            self._stepping = True
            self.s.world.sched.later(STEP_S, lambda: self.s.inst.model.submit(lambda owner: self.step()), self.s.inst)

    def _position(self, seq: SimRequest) -> int:
        return seq.prompt_len + seq.meta["generated"]

    def _missing(self, seq: SimRequest) -> int:
        return max(0, pages_for(self._position(seq) + 1, self.s.page_size) - len(seq.pages))

    def step(self) -> None:
        """``DecodeLoop.step``: resume what fits, retract what the others' growth needs, grow, decode a token."""
        self._stepping = False
        allocator = self.s.allocator
        self._resume()
        by_age = sorted(self.running, key=lambda seq: seq.meta["order"])
        demands = [(seq, len(seq.pages), self._missing(seq)) for seq in by_age]
        for seq in pick_retractions(demands, allocator.free_pages):
            self._retract(seq)
        for seq in list(self.running):
            missing = self._missing(seq)
            if missing > 0:
                try:
                    seq.pages.extend(allocator.extend(seq.key, missing))
                except OutOfPages:  # only the oldest, while pages are held outside the batch: it waits a step
                    continue
            page = seq.pages[self._position(seq) // self.s.page_size]
            allocator.check_write(seq.key, [page], "a decode step", transfer=False)
            seq.meta["generated"] += 1
            if seq.meta["generated"] >= seq.meta["target"]:
                self.running.remove(seq)
                self.s.finish(seq)
        if self.running or self.retracted:
            self._kick()

    def _retract(self, seq: SimRequest) -> None:
        """``DecodeLoop._retract``: every page back, the cached prefix unlocked; the tokens are kept."""
        self.running.remove(seq)
        if self.s.cache is not None:
            self.s.cache.unlock(seq.prefix)
            seq.prefix = NO_MATCH
        self.s.let_go(seq)
        self.s.allocator.give_back(seq.key)
        seq.pages = []
        self.retracted.append(seq)
        self.retracted.sort(key=lambda s: s.meta["order"])
        self.preempted += 1

    def _resume(self) -> None:
        """``DecodeLoop._resume``: the oldest retracted requests whose pages fit with headroom; their KV is
        recomputed (the pages are being written, the model thread busy) before they decode again."""
        allocator = self.s.allocator
        while self.retracted:
            seq = self.retracted[0]
            need = pages_for(self._position(seq) + 1, self.s.page_size)
            if not admits(allocator, need, self.s.prealloc.headroom):
                break
            try:
                seq.pages = allocator.extend(seq.key, need)
            except OutOfPages:
                break
            self.retracted.pop(0)
            self.recomputing += 1
            who = f"the recompute of room {seq.key}"
            allocator.begin(seq.pages, who)
            seconds = self._position(seq) * RECOMPUTE_TOKEN_S
            self.s.inst.model.busy_for(seconds)
            self.s.world.sched.later(seconds, lambda seq=seq, who=who: self._recomputed(seq, who), self.s.inst)

    def _recomputed(self, seq: SimRequest, who: str) -> None:
        self.recomputing -= 1
        self.s.allocator.end(seq.pages, who)
        self.s.allocator.wrote(seq.key, seq.pages)
        self.resumed += 1
        self.running.append(seq)
        self._kick()

    def counters(self) -> dict[str, Any]:
        return {"preempted": self.preempted, "resumed": self.resumed}
