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
(``Node(commit_by_loop=True)``) and the loop commits each member's journal once, at the end of its pass, or at the
end of ``held`` when the pass ran inside it (the model thread's step): a handoff's six transitions, each its own
commit before, cost one commit per journal. The loop's own thread commits after it lets go of the lock, and ``held``
first commits whatever is still buffered (a flush under way on the other thread holds the journal's write lock, so
it waits for that one): the model thread's step waits for no commit it does not need (on the chip it waited for
the loop thread's commits about 7% of its busy time, round r13's stack samples). Each commit hands the interpreter's
lock to another thread that wants it (the driver releases it around SQLite's work), and the model thread waited for
it back up to the switch interval, 5 ms, a commit: P's handoff took 3.0-3.4 ms at p50 on a loaded CPU and 3.3 ms on
the chip. It is safe where every effect of every member stays in the process and dies with it (``--role pd`` on one
pool: the pages, the peer, the decode batch): a crash before the commit loses rows whose effects are lost with them,
and no token of a room the journal does not hold leaves before the commit, since the model thread's next step waits
for it, and a first token streamed mid-step is preceded by a ``commit`` of its own (``DecodeEngine.react``). What
does leave at once, a room's failure told to its client, is committed at once (``Node.step``).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

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
            if not outer:  # what the loop's thread buffered (it commits after letting go): before this step's effects
                self.commit()
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
                    self.commit()

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
            # the commit outside the lock: a step of the model thread waits for no commit of ours, only for one it
            # needs (``held`` commits what is still buffered; a flush under way holds the journal's write lock)
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

    def commit(self) -> None:
        """Commit every member's buffered rows now (``commit_per_pass`` only): at the ends of passes and ``held``,
        and by the holder before an effect that leaves the process (a shared pool's decode engine streaming a first
        token mid-step)."""
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
