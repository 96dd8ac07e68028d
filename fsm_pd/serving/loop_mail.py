"""Calls into an event loop from other threads, with one wake-up of that loop at a time.

The model thread hands each request's tokens to the event loop that streams them (``RequestStream.push``). With a
``call_soon_threadsafe`` per push, every push wrote the loop's self-pipe: the loop's thread woke, took the
interpreter's lock, and the model thread waited to get it back until the loop let go of it (its next system call,
or the switch interval, 5 ms). On a CPU
(tiny model, ``--role pd``, one stream) a push held the model thread 0.93 ms, more than its decode step; a step of
64 streams pushed 64 times. Here a push only queues its call, and wakes the loop only if no wake is already on its
way: the calls of one step reach the loop with one wake, in the order they were made.

A ``barrier`` holds every call posted after it until it is released (from any thread), the calls before it going on
as usual: ``--role pd`` on one pool streams a handoff's first token only once the journal holds the handoff's rows,
and commits them on a thread of its own (``SharedPool.outputs_after_commit``), so the model thread that decided
them neither waits for the commit nor lets the token out before it.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import threading
from collections.abc import Callable
from typing import Any


class Barrier:
    """A place in a ``LoopMail``'s order that no call passes before ``release``."""

    __slots__ = ("_mail", "released")

    def __init__(self, mail: LoopMail) -> None:
        self._mail, self.released = mail, False

    def release(self) -> None:
        """Any thread: the calls held behind it go on (with those behind the barriers before it, once released)."""
        self._mail._release(self)


class LoopMail:
    """The calls queued for one event loop (``mail_for``): ``post`` from any thread, run on the loop in order."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._calls: collections.deque[tuple[Callable[[Any], None], Any]] = collections.deque()
        self._woken = False  # a wake is on its way: the calls posted before ``_run`` begins ride on it
        self._held = 0  # barriers not yet released: a call posted meanwhile needs no wake until one is
        self._barrier_lock = threading.Lock()
        self.wakes = 0

    def post(self, callback: Callable[[Any], None], arg: Any) -> None:
        """Run ``callback(arg)`` on the loop, after every call posted before it. Raises RuntimeError if the loop is
        closed and was not already (the caller's to judge), as ``call_soon_threadsafe`` does."""
        self._calls.append((callback, arg))
        if self._woken or self._held:
            return
        self._wake()

    def barrier(self) -> Barrier:
        """Any thread: hold every call posted from now on until the returned barrier is released."""
        barrier = Barrier(self)
        with self._barrier_lock:
            self._held += 1
            self._calls.append((None, barrier))
        return barrier

    def _release(self, barrier: Barrier) -> None:
        with self._barrier_lock:
            if barrier.released:
                return
            barrier.released = True
            self._held -= 1
        if not self._woken:
            with contextlib.suppress(RuntimeError):  # the loop is closed (its server stopped): nobody is left to read
                self._wake()

    def _wake(self) -> None:
        self._woken = True
        self.wakes += 1
        try:
            self._loop.call_soon_threadsafe(self._run)
        except RuntimeError:
            self._woken = False
            raise

    def _run(self) -> None:
        # cleared before draining: a call posted from here on either is drained below or wakes the loop again
        self._woken = False
        calls = self._calls
        while calls:
            callback, arg = calls[0]
            if callback is None:  # a barrier: its release wakes the loop again
                if not arg.released:
                    return
                calls.popleft()
                continue
            calls.popleft()
            try:
                callback(arg)
            except Exception as exc:  # one failed call must not hold back the others' tokens
                self._loop.call_exception_handler({"message": "a call posted to the event loop failed",
                                                   "exception": exc})


_mail: dict[asyncio.AbstractEventLoop, LoopMail] = {}
_mail_lock = threading.Lock()


def mail_for(loop: asyncio.AbstractEventLoop) -> LoopMail:
    """The one ``LoopMail`` of ``loop`` (one per loop, so that its calls keep one order and share its wakes)."""
    mail = _mail.get(loop)
    if mail is None:
        with _mail_lock:
            for closed in [known for known in _mail if known.is_closed()]:  # a stopped server's loop
                del _mail[closed]
            mail = _mail.setdefault(loop, LoopMail(loop))
    return mail
