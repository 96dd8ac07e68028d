"""``Committer``: journal commits on a thread of their own, for a loop whose rows are decided on the model thread.

``--role pd`` on one pool decides its rooms on the model thread (``NodeLoop.held``, ``run_pending``), and committed
their rows there too, once or twice a step. On a TPU v5e that was a tenth of the model thread's busy time under
prefill-heavy load (round r16's stack samples: 187 of 1,854 samples in ``Journal.flush``, SQLite's write and the wait
for the interpreter's lock after it), time in which the chip had nothing queued. Here the model thread only asks
(``soon``) and goes on to its next dispatch; this thread commits meanwhile, while the model thread waits on the
device.

What the commit still guards comes with it: ``soon(then)`` runs ``then`` once every row journaled before the call is
committed. The shared pool passes the release of an output barrier (``LoopMail.barrier``), so a first token decided
by a handoff reaches its client only after the handoff's rows are in the journal, as it did when the model thread
committed before streaming it (``SharedPool.outputs_after_commit``).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

log = logging.getLogger(__name__)


class Committer:
    def __init__(self, commit: Callable[[], None], name: str) -> None:
        """``commit``: commits every buffered row (``NodeLoop.commit``); it handles its own journal's failures."""
        self._commit = commit
        self._lock = threading.Lock()
        self._wanted = threading.Event()
        self._then: list[Callable[[], None]] = []
        self._closed = False
        self.commits = 0
        self._name = name
        self._thread: threading.Thread | None = None  # started by the first ``soon``

    def soon(self, then: Callable[[], None] | None = None) -> None:
        """Commit what is buffered now, on this thread; then call ``then`` (after the commit, on this thread; at
        once, after a commit on the caller's thread, once closed)."""
        with self._lock:
            if not self._closed:
                if then is not None:
                    self._then.append(then)
                if self._thread is None:
                    self._thread = threading.Thread(target=self._run, name=f"journal-commit[{self._name}]",
                                                    daemon=True)
                    self._thread.start()
                self._wanted.set()
                return
        self._commit()
        if then is not None:
            then()

    def close(self, timeout: float = 5.0) -> None:
        """Commit what is left, run what waits for it, and stop the thread."""
        with self._lock:
            self._closed, thread = True, self._thread
        if thread is None:
            return
        self._wanted.set()
        if thread is not threading.current_thread():
            thread.join(timeout=timeout)

    def _run(self) -> None:
        while True:
            self._wanted.wait()
            with self._lock:
                self._wanted.clear()
                then, self._then = self._then, []
                closed = self._closed
            try:
                self._commit()
                self.commits += 1
            except Exception:  # a journal's failure stops its own node (KVManager._guarded); this thread goes on
                log.exception("a commit of the journals failed")
            for call in then:  # after a failed commit too: the node that failed tells its requests so itself
                try:
                    call()
                except Exception:
                    log.exception("a call after a commit failed")
            if closed:
                return
