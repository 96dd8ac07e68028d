"""The programs requests needed and ran without: the background compile takes them before the rest of its plan.

A ready node runs a shape whose own program is not compiled yet on one that covers it (``programs.ForwardPrograms``:
row by row, or padded up), a sampler batch padded up to a prepared bucket (``sampling.sample``), and a batch whose
several-steps program is missing a step at a time (``multi_step.StepPrograms.find``). That is correct, and costly
when it lasts: a batch of 16 decoded row by row makes 16 calls a step, each fetching its logits (on a TPU v5e a
16-stream SmolLM2 load ran at 71 ms a token instead of 9, the background still compiling other shapes).

So each of those notes what it lacked here (``want``), and the background compile (``serving/warmup.py``) compiles
what was noted first, without waiting for the node to be idle: every step of the batch that lacks it pays more than
the compile's share of the interpreter's lock would. ``FALLBACK`` before ``LOOP``: what a step at a time runs on
(forward passes, samplers: cheap to compile) comes before the several-steps program, so a node that runs several
steps a dispatch is at a step-at-a-time node's speed as soon as that one's would be.

Process-wide, like the programs it names (shared per model and pool) and the samplers' prepared buckets.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable

FALLBACK, LOOP = 0, 1  # priorities: what a step at a time runs on, then the several-steps programs

_lock = threading.Lock()
_queues: tuple[OrderedDict, OrderedDict] = (OrderedDict(), OrderedDict())  # by priority: key -> (kind, what, compile)
_noted: set = set()  # the keys queued or being compiled (and those that failed to: not tried again)
_wanted = threading.Event()  # set while a queue holds something


def want(key: Hashable, kind: str, what: str, compile_it: Callable[[], object], priority: int = FALLBACK) -> None:
    """Note that a request ran without the program ``key`` names; ``compile_it()`` prepares it (``kind``: the
    compile counters' kind; ``what``: its name in the log). Cheap when noted before: it runs on every covered call,
    on the model thread."""
    if key in _noted:  # a set lookup is atomic under the interpreter's lock: the lock only for a first note
        return
    with _lock:
        if key in _noted:
            return
        _noted.add(key)
        _queues[priority][key] = (kind, what, compile_it)
        _wanted.set()


def take() -> tuple[Hashable, str, str, Callable[[], object]] | None:
    """The first program wanted, of the first priority that has one, or None. It leaves the queue; wants of it are
    not noted again until ``done``."""
    with _lock:
        for queue in _queues:
            if queue:
                key, (kind, what, compile_it) = queue.popitem(last=False)
                return key, kind, what, compile_it
        _wanted.clear()
        return None


def done(key: Hashable) -> None:
    """``key``'s program is there: a later want of it (a sampler bucket the process forgot) is noted again."""
    with _lock:
        _noted.discard(key)


def wait(timeout: float) -> bool:
    """Wait up to ``timeout`` seconds for something to be wanted; whether it is."""
    return _wanted.wait(timeout)


def pending() -> int:
    with _lock:
        return sum(len(queue) for queue in _queues)
