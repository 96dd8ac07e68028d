"""Where a serving process's threads spend their time, sampled from inside it: ``FSM_PD_STACK_SAMPLES=PATH``.

On the TPU host no process may trace another (py-spy answered "Permission Denied", round r12), yet the question that
matters there is host-side: which thread runs which Python while the chip waits (a ``--role pd`` process's decode
steps were 3.7 ms slower than a colocated node's under long prompts). So a serving process can sample itself: a
daemon thread takes every thread's stack (``sys._current_frames``) ``FSM_PD_STACK_SAMPLES_HZ`` times a second
(default 100) and counts them, and the counts are written to PATH as collapsed stacks, one line each, the format
py-spy's ``--format raw`` and flamegraph tools read: ``thread (NAME);file.py:function:line;... COUNT``, outermost
frame first. The file is rewritten every ``WRITE_EVERY_S`` and when the process ends (``process_exit.on_exit``).
``{pid}`` in PATH becomes the process's id, so that the servers a bench starts one after another (they inherit the
variable) each keep their own.

What it sees: the sampler runs only when it holds the interpreter's lock, so each sample catches the others where
they let go of it or were made to (every ``sys.getswitchinterval()`` of pure Python): a thread waiting in C (on the
device, a socket, a lock) shows that wait, and a thread running Python shows its Python, at most a switch interval
late. A thread's share of samples is its share of the process's time; which thread held the lock needs py-spy's
``--gil``. Off unless the variable is set: sampling costs the lock 100 times a second.
"""

from __future__ import annotations

import collections
import os
import sys
import threading
import time
from pathlib import Path

ENV, HZ_ENV = "FSM_PD_STACK_SAMPLES", "FSM_PD_STACK_SAMPLES_HZ"
WRITE_EVERY_S = 5.0


class StackSampler:
    def __init__(self, path: str | os.PathLike, hz: float = 100.0) -> None:
        if hz <= 0:
            raise ValueError(f"{HZ_ENV} must be above 0, got {hz}")
        self.path, self.interval_s = Path(path), 1.0 / hz
        self.counts: collections.Counter[str] = collections.Counter()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="stack-sampler", daemon=True)

    def start(self) -> StackSampler:
        self._thread.start()
        return self

    def sample(self) -> None:
        """One sample of every thread but this one."""
        names = {t.ident: t.name for t in threading.enumerate()}
        me = threading.get_ident()
        stacks = [collapsed(names.get(ident, str(ident)), frame)
                  for ident, frame in sys._current_frames().items() if ident != me]
        with self._lock:
            self.counts.update(stacks)

    def write(self) -> None:
        """The counts so far to ``path``, whole (a reader never sees half a file: written aside, then renamed)."""
        with self._lock:
            lines = [f"{stack} {n}\n" for stack, n in self.counts.most_common()]
        aside = self.path.with_name(self.path.name + ".part")
        aside.write_text("".join(lines))
        aside.replace(self.path)

    def stop(self) -> None:
        self._stop.set()
        self.write()

    def _run(self) -> None:
        last_write = time.monotonic()
        while not self._stop.wait(self.interval_s):
            self.sample()
            if time.monotonic() - last_write >= WRITE_EVERY_S:
                self.write()
                last_write = time.monotonic()


def collapsed(thread_name: str, frame) -> str:
    """``thread (NAME);outermost;...;innermost``, each frame ``file:function:line`` (the file's last two parts)."""
    parts = []
    while frame is not None:
        code = frame.f_code
        where = "/".join(Path(code.co_filename).parts[-2:])
        parts.append(f"{where}:{code.co_name}:{frame.f_lineno}")
        frame = frame.f_back
    return ";".join([f"thread ({thread_name})", *reversed(parts)])


def start_from_env(environ=os.environ) -> StackSampler | None:
    """A started sampler when ``FSM_PD_STACK_SAMPLES`` names a file, written at exit too; else None."""
    path = environ.get(ENV)
    if not path:
        return None
    from fsm_pd.runtime.process_exit import on_exit

    sampler = StackSampler(path.replace("{pid}", str(os.getpid())), float(environ.get(HZ_ENV, "100"))).start()
    on_exit(sampler.stop)
    return sampler
