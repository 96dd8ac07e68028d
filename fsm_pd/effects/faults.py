"""Fault injection for drills and end-to-end fault tests: off unless ``FSM_PD_FAULT_*`` variables are set.

``FaultConfig.from_env()`` reads them when a node's effect handlers are built; ``Faults`` holds the hooks the
handlers consult. ``FSM_PD_FAULT_FILE`` names a file of ``FSM_PD_FAULT_NAME=value`` lines that are read over the
environment's, and again whenever the file changes: a drill changes the faults of a running node, which a restart
would otherwise cost (the end-to-end fault tests run several faults on one set of servers that way).

Every injected failure becomes an ``error`` event whose reason contains ``injected fault: <stage> failed`` after
the handler's own words (``local error: pull failed: injected fault: ...``), so ``fsm-pd replay`` tells drills
from real failures. Variables (probabilities are in [0, 1], per attempt):

| variable | effect |
| --- | --- |
| ``FSM_PD_FAULT_GATHER``, ``..._PUBLISH`` (prefill), ``..._PULL``, ``..._SCATTER`` (decode) | fail that stage |
| ``FSM_PD_FAULT_DROP_MESSAGE`` | drop an outgoing side-channel message silently, as a lossy network would |
| ``FSM_PD_FAULT_DELAY_MESSAGE_S`` and ``FSM_PD_FAULT_DELAY_MESSAGE_P`` (default 1) | send it that much later |
| ``FSM_PD_FAULT_MESSAGES`` | which kinds the two above touch, e.g. ``READY,PULLED`` (default: all) |
| ``FSM_PD_FAULT_PULL_DELAY_S`` | hold each pull back this long (a slow decode or link) |
| ``FSM_PD_FAULT_CORRUPT_PULL`` | flip one byte of a pulled KV entry on the decode node, before it is written into
  its pages (the wire corrupted it; the KV checksum must catch it: ``effects/checksums.py``); any backend |
| ``FSM_PD_FAULT_CRASH_AT`` | ``os._exit`` the process the first time it reaches that point (``CRASH_POINTS``) |
| ``FSM_PD_FAULT_SEED`` | seed of the dice, for repeatable drills |
| ``FSM_PD_FAULT_PAUSE_FILE`` | nothing is injected while this file exists (warm up first; end a drill live) |
| ``FSM_PD_FAULT_FILE`` | more of the variables above, one ``NAME=value`` a line (``#`` comments), over the
  environment's; read again when the file changes (replace it whole: write another, rename it over this one) |

An unknown ``FSM_PD_FAULT_*`` variable, a probability outside [0, 1] or an unknown crash point is an error at start:
a misspelt drill must not silently run fault-free. A fault file that goes bad while the node runs is logged as an
error and the faults stay what they were.
"""

from __future__ import annotations

import logging
import os
import random
import sys
import threading
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fsm_pd.effects.ports import OnProgress

log = logging.getLogger(__name__)

PREFIX = "FSM_PD_FAULT_"
STAGES = ("gather", "publish", "pull", "scatter")
MESSAGE_KINDS = ("PREPARE", "READY", "PULLED", "ABORT")
# where FSM_PD_FAULT_CRASH_AT can kill the process, in the order a transfer passes them
CRASH_POINTS = {
    "prefill": ("before_gather", "after_gather", "after_publish", "after_ready", "after_pulled"),
    "decode": ("after_prepare", "before_pull", "after_pull", "before_scatter", "after_scatter"),
}
CRASH_EXIT_CODE = 70  # distinguishable from a signal's 128+N in a test's assertion
_KNOWN = {
    *(s.upper() for s in STAGES),
    "DROP_MESSAGE",
    "DELAY_MESSAGE_S",
    "DELAY_MESSAGE_P",
    "MESSAGES",
    "PULL_DELAY_S",
    "CORRUPT_PULL",
    "CRASH_AT",
    "SEED",
    "PAUSE_FILE",
    "FILE",
}


class InjectedFault(Exception):
    """A failure the fault injection made up; its message is the reason journaled with the ``error`` event."""


@dataclass(frozen=True)
class FaultConfig:
    stages: Mapping[str, float] = field(default_factory=dict)  # stage -> probability of failing it
    drop_message: float = 0.0
    delay_message_s: float = 0.0
    delay_message_p: float = 1.0
    messages: frozenset[str] = frozenset(MESSAGE_KINDS)
    pull_delay_s: float = 0.0
    corrupt_pull: float = 0.0
    crash_at: str | None = None
    seed: int | None = None
    pause_file: str | None = None
    file: str | None = None
    # the environment's settings (names without the prefix), which a changed fault file is read over again
    environment: Mapping[str, str] = field(default_factory=dict, compare=False, repr=False)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] = os.environ) -> FaultConfig:
        given = {k[len(PREFIX) :]: v.strip() for k, v in environ.items() if k.startswith(PREFIX)}
        found = dict(given)
        if given.get("FILE"):
            found.update(read_fault_file(given["FILE"]))
        unknown = sorted(set(found) - _KNOWN)
        if unknown:
            raise ValueError(
                f"unknown fault variable(s) {', '.join(PREFIX + u for u in unknown)}; "
                f"known: {', '.join(PREFIX + k for k in sorted(_KNOWN))}"
            )
        stages = {s: _probability(found, s.upper()) for s in STAGES if found.get(s.upper())}
        kinds = frozenset(k.strip().upper() for k in found.get("MESSAGES", "").split(",") if k.strip())
        if kinds - set(MESSAGE_KINDS):
            raise ValueError(
                f"{PREFIX}MESSAGES: unknown kind(s) {sorted(kinds - set(MESSAGE_KINDS))}; "
                f"known: {', '.join(MESSAGE_KINDS)}"
            )
        crash = found.get("CRASH_AT") or None
        if crash is not None and crash not in {p for points in CRASH_POINTS.values() for p in points}:
            raise ValueError(
                f"{PREFIX}CRASH_AT={crash!r} is not a crash point; known: "
                + "; ".join(f"{role}: {', '.join(p)}" for role, p in CRASH_POINTS.items())
            )
        try:
            seed = int(found["SEED"]) if found.get("SEED") else None
        except ValueError:
            raise ValueError(f"{PREFIX}SEED={found['SEED']!r} is not an integer") from None
        return cls(
            stages={s: p for s, p in stages.items() if p > 0},
            drop_message=_probability(found, "DROP_MESSAGE"),
            delay_message_s=_seconds(found, "DELAY_MESSAGE_S"),
            delay_message_p=_probability(found, "DELAY_MESSAGE_P", 1.0),
            messages=kinds or frozenset(MESSAGE_KINDS),
            pull_delay_s=_seconds(found, "PULL_DELAY_S"),
            corrupt_pull=_probability(found, "CORRUPT_PULL"),
            crash_at=crash,
            seed=seed,
            pause_file=found.get("PAUSE_FILE") or None,
            file=found.get("FILE") or None,
            environment=given,
        )

    def reread(self) -> FaultConfig:
        """The settings again: the environment's, and the fault file's as it is now."""
        return FaultConfig.from_env({PREFIX + k: v for k, v in self.environment.items()})

    @property
    def enabled(self) -> bool:
        return bool(self.stages or self.drop_message or self.delay_message_s or self.pull_delay_s or self.crash_at
                    or self.corrupt_pull)

    def describe(self) -> dict:
        """The active settings, for logs and ``info()``."""
        out = {f"fail_{s}": p for s, p in self.stages.items()}
        if self.drop_message:
            out["drop_message"] = self.drop_message
        if self.delay_message_s:
            out.update(delay_message_s=self.delay_message_s, delay_message_p=self.delay_message_p)
        if (self.drop_message or self.delay_message_s) and self.messages != frozenset(MESSAGE_KINDS):
            out["messages"] = sorted(self.messages)
        if self.pull_delay_s:
            out["pull_delay_s"] = self.pull_delay_s
        if self.corrupt_pull:
            out["corrupt_pull"] = self.corrupt_pull
        if self.crash_at:
            out["crash_at"] = self.crash_at
        return out


def read_fault_file(path: str) -> dict[str, str]:
    """A fault file's settings (names without the prefix); none while it does not exist."""
    try:
        text = Path(path).read_text()
    except FileNotFoundError:
        return {}
    found = {}
    for number, line in enumerate(text.splitlines(), 1):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        name, equals, value = line.partition("=")
        name = name.strip()
        if not equals or not name.startswith(PREFIX) or name[len(PREFIX) :] in ("FILE", "PAUSE_FILE"):
            raise ValueError(f"{PREFIX}FILE {path}, line {number}: not a {PREFIX}NAME=value setting: {line!r}")
        found[name[len(PREFIX) :]] = value.strip()
    return found


def _file_stamp(path: str | None) -> tuple | None:
    """What tells a changed fault file from the one read: its inode, size and time of change; None if absent."""
    if path is None:
        return None
    try:
        stat = os.stat(path)
    except FileNotFoundError:
        return None
    return stat.st_ino, stat.st_size, stat.st_mtime_ns


def _probability(found: Mapping[str, str], name: str, default: float = 0.0) -> float:
    text = found.get(name)
    if not text:
        return default
    try:
        value = float(text)
    except ValueError:
        raise ValueError(f"{PREFIX}{name}={text!r} is not a probability") from None
    if not 0.0 <= value <= 1.0:
        raise ValueError(f"{PREFIX}{name}={text!r} is not a probability in [0, 1]")
    return value


def _seconds(found: Mapping[str, str], name: str) -> float:
    text = found.get(name)
    if not text:
        return 0.0
    try:
        value = float(text)
    except ValueError:
        raise ValueError(f"{PREFIX}{name}={text!r} is not a number of seconds") from None
    if value < 0:
        raise ValueError(f"{PREFIX}{name}={text!r} must not be negative")
    return value


class Faults:
    """The hooks of one node. Thread-safe: handlers call them from the loop, model and pull-worker threads."""

    def __init__(
        self, config: FaultConfig | None = None, *, role: str = "prefill", exit: Callable[[int], None] = os._exit
    ):
        self.role = role
        self.injected: Counter[str] = Counter()  # what was injected so far (stage, drop:KIND, delay:KIND), ever
        self._lock = threading.Lock()
        self._exit = exit
        self._use(config if config is not None else FaultConfig())
        self._stamp = _file_stamp(self._config.file)

    def _use(self, config: FaultConfig) -> None:
        self._config, self._rng = config, random.Random(config.seed)
        # nothing set and no file to set anything later: every hook answers at once. A --role pd handoff passes
        # about thirty of them (each a property or two and a roll) on the model thread
        self.off = not config.enabled and config.file is None
        if config.crash_at and config.crash_at not in CRASH_POINTS[self.role]:
            log.warning("%sCRASH_AT=%s is not a %s point: it never fires here", PREFIX, config.crash_at, self.role)
        if config.enabled:
            log.warning("fault injection is ON for this %s node: %s", self.role, config.describe())

    @property
    def config(self) -> FaultConfig:
        """The settings in force: read again first if the fault file changed since they were read."""
        if self._config.file is not None and _file_stamp(self._config.file) != self._stamp:
            with self._lock:
                stamp = _file_stamp(self._config.file)
                if stamp != self._stamp:
                    self._stamp = stamp
                    try:
                        self._use(self._config.reread())
                        log.warning("fault settings read again from %s: %s", self._config.file,
                                    self._config.describe() or "none")
                    except ValueError as exc:  # a drill's typo: say so, and keep what was in force
                        log.error("fault file %s not taken, the faults stay %s: %s", self._config.file,
                                  self._config.describe() or "none", exc)
        return self._config

    @property
    def paused(self) -> bool:
        return self.config.pause_file is not None and os.path.exists(self.config.pause_file)

    def _roll(self, p: float) -> bool:
        if p <= 0 or self.paused:
            return False
        with self._lock:
            return self._rng.random() < p

    def _count(self, what: str) -> None:
        with self._lock:
            self.injected[what] += 1

    def check(self, stage: str) -> None:
        """Raise ``InjectedFault`` with probability ``FSM_PD_FAULT_<STAGE>``."""
        if self.off:
            return
        p = self.config.stages.get(stage, 0.0)
        if self._roll(p):
            self._count(stage)
            raise InjectedFault(f"injected fault: {stage} failed ({PREFIX}{stage.upper()}={p:g})")

    def message(self, kind: str) -> float | None:
        """For an outgoing message: None to drop it, else the seconds to hold it back (0: send now)."""
        if self.off:
            return 0.0
        c = self.config
        if kind not in c.messages:
            return 0.0
        if self._roll(c.drop_message):
            self._count(f"drop:{kind}")
            log.info("fault injection dropped a %s message", kind)
            return None
        if c.delay_message_s and self._roll(c.delay_message_p):
            self._count(f"delay:{kind}")
            return c.delay_message_s
        return 0.0

    def later(self, seconds: float, action: Callable[[], None]) -> None:
        """Run ``action`` on its own daemon thread after ``seconds`` (a delayed message)."""
        timer = threading.Timer(seconds, action)
        timer.daemon = True
        timer.start()

    @property
    def pull_delay_s(self) -> float:
        return 0.0 if self.off or self.paused else self.config.pull_delay_s

    def corrupting(self) -> Corruption | None:
        """For one pulled KV entry: with probability ``FSM_PD_FAULT_CORRUPT_PULL``, its ``Corruption``."""
        return None if self.off else Corruption(self) if self._roll(self.config.corrupt_pull) else None

    def crash(self, point: str) -> None:
        """Exit at once, without cleanup (like SIGKILL), if ``FSM_PD_FAULT_CRASH_AT`` names ``point``."""
        if self.off or self.config.crash_at != point or self.paused:
            return
        self._count(f"crash:{point}")
        message = f"fault injection: crashing the {self.role} process at {point} ({PREFIX}CRASH_AT)\n"
        try:
            sys.stderr.write(message)
            sys.stderr.flush()
        finally:
            self._exit(CRASH_EXIT_CODE)

    def counters(self) -> dict:
        with self._lock:
            return dict(self.injected)


class Corruption:
    """One pulled KV entry that ``FSM_PD_FAULT_CORRUPT_PULL`` corrupts: one byte flipped (XOR 0xFF of the
    second-highest byte of its first element: a value off by a power of two or more, on the first page's first
    layer), once, before anything is written into the decode node's pages from it.

    Where: in the entry's arrays as the pull hands them over (``landed``, through the pool port's ``corrupt``: on
    the array's device, so on every backend), or, where a streamed write consumes the bytes as they land (a
    progressive backend into a pool on the CPU), in those bytes before the stream sees them (``hook``): the layers a
    stream writes during the pull would otherwise come from bytes the flip never reached."""

    def __init__(self, faults: Faults) -> None:
        self.faults = faults
        self.flipped = False

    def hook(self, on_progress: OnProgress) -> OnProgress:
        """The stream's progress hook, the byte flipped in the landed host bytes first."""

        def report(index: int, host: Any, landed: int) -> None:
            byte = host.dtype.itemsize - 2 if host.dtype.itemsize > 1 else 0
            if not self.flipped and landed > byte:
                self.flipped = True
                host.reshape(-1).view("uint8")[byte] ^= 0xFF
                self._done(f"byte {byte} as it landed")
            on_progress(index, host, landed)

        return report

    def landed(self, staging: Any, corrupt: Callable[[Any], Any]) -> Any:
        """The pulled array to write: ``corrupt(staging)`` (the pool port's), unless the hook flipped it already."""
        if self.flipped:
            return staging
        self.flipped = True
        staging = corrupt(staging)
        self._done("the first element's byte in the pulled array")
        return staging

    def _done(self, what: str) -> None:
        self.faults._count("corrupt_pull")
        log.info("fault injection flipped %s of a pulled KV entry", what)
