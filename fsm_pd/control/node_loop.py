"""``NodeLoop``: what steps nodes: a node process's one, or both of ``--role pd``'s, on one thread and one lock.

A node's rooms change only in ``Node.step``, and a loop's steps run under its lock: on the loop's own thread, or on a
thread that calls ``run_pending`` while the lock is free. A process that runs both roles (``--role pd``) gives both
managers one loop: a message one node hands the other (``InProcessSenders``) lands in the other's inbox and is
decided in the same pass, so a handoff's READY, PULLED and their transitions cost no thread hop. With the shared
pool, the model thread holds the loop through each step of its engines and runs the pass after each engine step:
P's ``kv_ready``, which the step submitted, runs to both rooms' Success before the next step, with no thread to
wake. With a loop each, every hop waited for the interpreter's lock, which the model thread holds while it steps
(up to ``sys.getswitchinterval()``, 5 ms, a hop): P's handoff took 18-24 ms at p50 under 16 streams on the chip
(docs/tpu-rounds.md, "Fifth round"); on a loaded CPU, 12.8 ms against 1.9 with the loop held (tiny model, pd-always).

A pass steps every member until none has anything queued; a member whose node stopped (its journal could not be
written) is skipped, the others go on. The thread stops when the last member leaves.

``commit_per_pass`` (the shared pool's loop): a member's node journals its steps' rows without committing them
(``Node(commit_by_loop=True)``) and the loop commits each member's journal once a pass: the loop's own thread after
it lets go of the lock, and a pass run inside ``held`` (the model thread's step) on a thread of its own
(``committer.py``) once ``held`` ends: a handoff's six transitions, each its own commit before, cost one commit per
journal, and the model thread waits for none (on the chip its commits were a tenth of its busy time, round r16).
It is safe where every effect of every member stays in the process and dies with it (``--role pd`` on one pool: the
pages, the peer, the decode batch): a crash before the commit loses rows whose effects are lost with them. What
leaves the process waits for the commit: a first token that a handoff decided is streamed behind an output barrier
that the commit releases (``commit_soon``, ``SharedPool.outputs_after_commit``), and a room's failure told to its
client is committed at once (``Node.step``).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from fsm_pd.control.committer import Committer

IDLE_WAKE_S = 0.05  # an idle loop still wakes this often: each member's journal keep-alive


class NodeLoop:
    def __init__(self, name: str, *, commit_per_pass: bool = False) -> None:
        self.name = name
        self.commit_per_pass = commit_per_pass  # members' nodes leave their commits to the loop (module docstring)
        self._holding = False  # inside ``held``: its end commits the passes run within it
        self.wakeup = Wakeup()  # every member's node sets it (``Node(wakeup=...)``)
        self._members: list[Any] = []
        self._stepping = threading.RLock()  # held while a member steps: leaving waits for its step to end
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        # the commits of the passes run inside ``held`` (commit_per_pass), off the holder's thread
        self._committer = Committer(self.commit, name) if commit_per_pass else None

    def join(self, member: Any) -> None:
        """Step ``member`` from now on: it has ``node`` (a ``Node`` made with this loop's ``wakeup``, and
        ``commit_by_loop=commit_per_pass``), ``active()`` (False once it stopped), ``step_once()``, ``commit()``
        (its journal's buffered rows) and ``keep_alive()``. The thread starts with the first member."""
        with self._stepping:
            if member not in self._members:
                self._members.append(member)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=f"fsm-loop[{self.name}]", daemon=True)
                self._thread.start()
        self.wakeup.wake()

    def leave(self, member: Any, timeout: float = 5.0) -> None:
        """``member`` is stepped no more once this returns; the thread stops with the last member."""
        with self._stepping:
            if member in self._members:
                self._members.remove(member)
            last = not self._members
        if last:
            self._stop.set()
            self.wakeup.wake()
            if self._committer is not None:
                self._committer.close(timeout)
            thread = self._thread
            if thread is not None and thread is not threading.current_thread():
                thread.join(timeout=timeout)

    @property
    def started(self) -> bool:
        return self._thread is not None and self._thread.ident is not None

    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    @contextmanager
    def held(self) -> Iterator[None]:
        """Hold the loop's lock for a while (an engine step of ``--role pd``'s model thread): its own thread steps
        nothing meanwhile, and what was queued is decided by the holder (``run_pending``), not raced for. A submit
        wakes the loop's thread at once; without this it took each handoff the model thread's step had just started
        and ran it while the model thread ran on, the two trading the interpreter's lock every 5 ms."""
        with self._stepping:
            outer, self._holding = self._holding, True
            if not outer:
                self.wakeup.hushed = True
            try:
                yield
            finally:
                self._holding = outer
                if not outer:
                    self.wakeup.hushed = False
                    # queued by another thread while hushed, and after the holder's last pass: the loop's thread
                    # takes it now (a submit after this line wakes it itself)
                    if any(m.active() and m.node.pending for m in list(self._members)):
                        self.wakeup.set()
                    self.commit_soon()

    def run_pending(self) -> bool:
        """Decide what is queued now, on the caller's thread, unless a step runs elsewhere (then that one will):
        the model thread of ``--role pd`` calls this after each engine step, so a handoff its step started (P's
        ``kv_ready``) runs to both rooms' Success before the next step, with no thread to wake. True if it ran."""
        if not self._stepping.acquire(blocking=False):
            return False
        try:
            self._pass(keep_alive=False)
        finally:
            self._stepping.release()
        return True

    def _run(self) -> None:
        while not self._stop.is_set():
            self.wakeup.wait(IDLE_WAKE_S)
            with self._stepping:
                self._pass(keep_alive=True, commit=not self.commit_per_pass)
            # the commit outside the lock: a step of the model thread waits for no commit of ours
            self.commit()

    def _pass(self, keep_alive: bool, commit: bool = True) -> None:
        members = [m for m in self._members if m.active()]
        if not members:
            # only a member's step clears the wakeup: with every member stopped (a journal that failed) the thread
            # would find it set and spin; cleared here, then looked again, so a member that joined meanwhile is seen
            self.wakeup.clear()
            members = [m for m in self._members if m.active()]
        # Node.step clears the shared wakeup before it reads its own inbox: a message one member queued for another
        # after that other stepped is found here, not lost until the next idle wake
        while members:
            for member in members:
                # what a member's own handlers reported during its step (a gather's ``published``, a pull taken at
                # once) is decided before the next member's turn: a pass per hop cost every other member an empty step
                while member.active():
                    member.step_once()
                    if not member.node.pending:
                        break
            if not any(m.active() and m.node.pending for m in members):
                break
        if commit and not self._holding:
            self.commit()
        for member in members if keep_alive else ():
            if member.active():
                member.keep_alive()

    def commit_soon(self, then: Callable[[], None] | None = None) -> None:
        """Commit every member's buffered rows (``commit_per_pass`` only), on the committer's thread, and then call
        ``then``: the end of ``held``, and an output barrier's release (``SharedPool.outputs_after_commit``). Without
        a committer (a loop of its own rows), now, on this thread."""
        if self._committer is not None:
            self._committer.soon(then)
            return
        self.commit()
        if then is not None:
            then()

    def commit(self) -> None:
        """Commit every member's buffered rows now (``commit_per_pass`` only): at the ends of the loop thread's
        passes, and on the committer's thread."""
        if self.commit_per_pass:
            for member in list(self._members):  # a copy: the loop's thread commits outside the lock
                if member.active():
                    member.commit()


class Wakeup:
    """The loop thread's wake-up, a ``threading.Event`` (``set``, ``is_set``, ``clear``, ``wait``) that is hushed while
    a thread holds the loop (``NodeLoop.held``). Every ``Node.submit`` sets it, so a handoff decided on the model
    thread inside ``held`` woke the loop's thread five times for nothing: it could only wait for the lock, and each
    wake cost the holder the interpreter's lock at its next release and then the lock's hand-over back, and an empty
    pass once the step let go. Hushed, it reads as set, so a submit skips it; what another thread queues meanwhile is
    decided by the holder's next pass, or woken for when ``held`` ends."""

    __slots__ = ("_event", "hushed")

    def __init__(self) -> None:
        self._event = threading.Event()
        self.hushed = False

    def is_set(self) -> bool:
        return self.hushed or self._event.is_set()

    def set(self) -> None:
        if not self.hushed:
            self._event.set()

    def wake(self) -> None:
        """Set, hushed or not (a member joins or the loop stops)."""
        self._event.set()

    def clear(self) -> None:
        if self._event.is_set():
            self._event.clear()

    def wait(self, timeout: float | None = None) -> bool:
        return self._event.wait(timeout)
