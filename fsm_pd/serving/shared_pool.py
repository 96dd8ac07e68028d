"""``SharedPool``: one engine core under both roles of ``--role pd`` on one set of devices.

One KV pool and one model thread, one page allocator (each engine keys its rooms apart: ``PageAllocator.view``), one
step budget and one step loop. Each step of that loop runs the decode engine's step first (its running batch, its
admissions) and then the prefill engine's, whose chunk the shared ``StepBudget`` sizes by what a decode step costs
while streams decode: a prefill burst delays a stream's next token by at most about ``chunk_steps`` decode steps,
as on a colocated node. A handoff between the two moves page ownership (backend ``pool``, ``control/pool_kv.py``),
decided on this thread right after the step that finished the prompt (``NodeLoop.run_pending``). After each pass,
the engines take the rooms' events it decided (``_react``): a prompt the prefill engine computed before its PREPARE
(``early_prefill.py``) starts its handoff as soon as PREPARE lands, and the decode engine streams the first token of
a handoff that ended, instead of each waiting for its engine's next step.

Why one loop rather than two engines with their own threads: on one TensorCore the two halves never run at once, so
splitting them adds no compute; two model threads only contend for the chip and the interpreter lock, and neither
could bound the other's steps (issue 48: 0.24-0.35x a colocated node's throughput on a TPU v5e).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from fsm_pd.control.node_loop import NodeLoop
from fsm_pd.kvpool.pages import PageAllocator
from fsm_pd.model.model_thread import ModelThread
from fsm_pd.scheduling.step_budget import StepBudget
from fsm_pd.serving.step_driver import StepDriver

log = logging.getLogger(__name__)

ORDER = ("decode", "prefill")  # decode rows first in every step


class SharedPool:
    def __init__(self, model: Any, *, num_pages: int, page_size: int, chunked_prefill_size: int,
                 prefill_chunk_steps: float, name: str = "pd") -> None:
        self.num_pages, self.page_size = num_pages, page_size
        self.layout = model.make_kv_layout(num_pages, page_size)
        self.model_thread = ModelThread(model.make_pool(self.layout), name=f"model[{name}]")
        self.allocator = PageAllocator(num_pages)
        self.budget = StepBudget(chunked_prefill_size, prefill_chunk_steps)
        self.decoding: Callable[[], bool] = lambda: False  # the decode engine says whether streams run
        # the prefill engine says whether a prompt waits for its prefill: the decode engine's dispatches then run one
        # step each, so that prefill never queues behind K steps on the device (``DecodeLoop``, several a dispatch)
        self.prefill_waiting: Callable[[], bool] = lambda: False
        # the pages the decode engine keeps free when it reserves a prompt's: a prompt the prefill engine computes
        # before its PREPARE leaves them free too (``early_prefill.py``)
        self.decode_headroom = 0
        # both engines' KV managers are stepped by it; a step holds it, and what the step queued is decided right
        # after it, on this thread (``NodeLoop.held``, ``run_pending``): a handoff waits for no other thread
        # nothing their steps do leaves the process before the step's end: one commit per journal a step
        self.node_loop = NodeLoop(name, commit_per_pass=True)
        self._members: dict[str, Member] = {}
        self._driver = StepDriver(self.model_thread, self._step, name=f"{name} scheduler")

    def member(self, role: str, step: Callable[[], bool], engine: Any = None) -> Member:
        """The step driver an engine of ``role`` uses: its kicks reach the one loop, which runs its ``step``."""
        if role not in ORDER or role in self._members:
            raise ValueError(f"a shared pool takes one engine of each role {ORDER}, not another {role!r}")
        member = self._members[role] = Member(self, step, engine)
        return member

    def engines(self) -> list[Any]:
        """The engines that share this pool and are whole (started): their warm-ups plan one set of programs between
        them. ``--role pd`` warms the decode engine's programs up while it builds the prefill engine, half built
        meanwhile."""
        return [m.engine for m in tuple(self._members.values()) if m.engine is not None and m.started]

    def kick(self) -> None:
        self._driver.kick()

    def close_member(self) -> bool:
        """True once every member has closed: then the model thread may stop."""
        if all(m.closed for m in self._members.values()):
            self._driver.close()
            return True
        return False

    @property
    def steps(self) -> int:
        return self._driver.steps

    def _step(self) -> bool:
        more = False
        with self.node_loop.held():
            for role in ORDER:
                member = self._members.get(role)
                if member is None or not member.started or member.closed:
                    continue
                try:
                    more = member.step() or more
                except Exception:  # one engine's failed step must not starve the other of its steps
                    log.exception("the %s engine's step failed", role)
                self.node_loop.run_pending()
                self._react()
        return more

    def _react(self) -> None:
        """Room events the last pass decided, taken at once by an engine that reacts to them without a step: the
        prefill engine starts the handoff of a prompt it prefilled before its PREPARE the moment PREPARE lands in
        the pass after the decode engine's step, not in its own step after that (``PrefillEngine.react``)."""
        for role, member in self._members.items():
            if member.react is None or not member.started or member.closed:
                continue
            try:
                reacted = member.react()
            except Exception:
                log.exception("the %s engine's reaction to its rooms failed", role)
                continue
            if reacted:
                self.node_loop.run_pending()


class Member:
    """What ``StepDriver`` is to an engine of its own, for an engine of a ``SharedPool``."""

    def __init__(self, pool: SharedPool, step: Callable[[], bool], engine: Any = None) -> None:
        self._pool, self.step, self.engine = pool, step, engine
        self.started = self.closed = False
        # taken after each pass of the loop: the engine's room events, acted on at once; True if it handed anything
        # to the loop (``SharedPool._react``)
        self.react: Callable[[], bool] | None = None

    def start(self) -> None:
        """The engine is whole: its steps may run (the loop starts with the first member)."""
        self.started = True
        self._pool._driver.start()
        self._pool.kick()

    def kick(self) -> None:
        self._pool.kick()

    def close(self) -> None:
        self.closed = True

    @property
    def steps(self) -> int:
        return self._pool.steps

    def timing(self) -> dict:
        return self._pool._driver.timing()
