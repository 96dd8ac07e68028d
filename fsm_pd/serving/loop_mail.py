"""Calls into an event loop from other threads, with one wake-up of that loop at a time.

The model thread hands each request's tokens to the event loop that streams them (``RequestStream.push``). With a
``call_soon_threadsafe`` per push, every push wrote the loop's self-pipe: the loop's thread woke, took the
interpreter's lock, and the model thread waited to get it back until the loop let go of it (its next system call,
or the switch interval, 5 ms). On a CPU
(tiny model, ``--role pd``, one stream) a push held the model thread 0.93 ms, more than its decode step; a step of
64 streams pushed 64 times. Here a push only queues its call, and wakes the loop only if no wake is already on its
way: the calls of one step reach the loop with one wake, in the order they were made.
"""

from __future__ import annotations

import asyncio
import collections
import threading
from collections.abc import Callable
from typing import Any


class LoopMail:
    """The calls queued for one event loop (``mail_for``): ``post`` from any thread, run on the loop in order."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._calls: collections.deque[tuple[Callable[[Any], None], Any]] = collections.deque()
        self._woken = False  # a wake is on its way: the calls posted before ``_run`` begins ride on it
        self.wakes = 0

    def post(self, callback: Callable[[Any], None], arg: Any) -> None:
        """Run ``callback(arg)`` on the loop, after every call posted before it. Raises RuntimeError if the loop is
        closed and was not already (the caller's to judge), as ``call_soon_threadsafe`` does."""
        self._calls.append((callback, arg))
        if self._woken:
            return
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
            callback, arg = calls.popleft()
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
