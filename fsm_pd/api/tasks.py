"""Ending tasks we no longer need: cancel them, wait for them, and hear how they ended.

``contextlib.suppress(BaseException)`` around awaiting a cancelled task hid two things: an error the task ended
with, and the caller's own cancellation arriving while it waited, after which the caller ran on as if it had not been
cancelled (a router request whose client had left went on to its retry). ``cancel_and_wait`` keeps both.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable
from functools import partial
from typing import Any

log = logging.getLogger(__name__)


async def cancel_and_wait(*tasks: asyncio.Future, what: str, expected: tuple[type[BaseException], ...] = ()) -> None:
    """Cancel ``tasks`` and wait until every one has ended. One that ends with an error other than its cancellation
    (and not one of ``expected``) is logged as a warning that names ``what``.

    If the caller is cancelled while this waits, its CancelledError propagates at once: the tasks are cancelled
    already, and how each ends is logged when it does."""
    for task in tasks:
        task.cancel()
    await wait_ended(*tasks, what=what, expected=expected)


def cancel_soon(*tasks: asyncio.Future, what: str, expected: tuple[type[BaseException], ...] = ()) -> None:
    """``cancel_and_wait`` for tasks nobody needs to see end: cancelled now, how each ends logged when it does, and
    no turn of the event loop spent waiting for that."""
    for task in tasks:
        task.cancel()
        task.add_done_callback(partial(_report, what=what, expected=expected))


async def wait_ended(*tasks: asyncio.Future, what: str, expected: tuple[type[BaseException], ...] = ()) -> None:
    """``cancel_and_wait`` for tasks ended some other way (an anyio cancel scope of their own): wait until each has
    ended and hear how, as it does."""
    try:
        if tasks:
            await asyncio.wait(tasks)  # raises nothing of the tasks', only the caller's own cancellation
    finally:
        for task in tasks:
            if task.done():
                _report(task, what, expected)
            else:
                task.add_done_callback(partial(_report, what=what, expected=expected))


def _report(task: asyncio.Future, what: str, expected: tuple[type[BaseException], ...]) -> None:
    if task.cancelled():
        return
    err = task.exception()  # retrieved either way: asyncio never reports it as "never retrieved"
    if err is not None and not isinstance(err, expected):
        log.warning("%s ended with %s: %s", what, type(err).__name__, err, exc_info=err)


LEFT = object()  # what ``unless_left`` returns when the client left first


async def unless_left(work: Awaitable[Any], left: Awaitable[None], what: str) -> Any:
    """``work``'s result, awaited in this task rather than a task of its own; ``LEFT`` if ``left`` (a client's
    disconnect) ends first, which cancels the work where it stands. A task handed over costs a turn of the event loop
    each way, and under load a turn can wait up to 5 ms for the interpreter's lock (issue 48: a pd request's first
    token took ~7 turns to reach its client, a colocated one's 2). A cancellation from elsewhere propagates."""
    me = asyncio.current_task()
    gone = asyncio.ensure_future(left)
    state = {"left": False, "ended": False}

    def on_leaving(task: asyncio.Future) -> None:
        # (a callback already queued when the work ended runs after it: this task has moved on by then)
        if not state["ended"] and not task.cancelled() and task.exception() is None:
            state["left"] = True
            me.cancel()

    gone.add_done_callback(on_leaving)
    try:
        result = await work
    except asyncio.CancelledError:
        if state["left"] and me.uncancel() == 0:  # cancelled by the leaving alone, not from outside too
            return LEFT
        raise
    finally:
        state["ended"] = True
        cancel_soon(gone, what=what)
    if state["left"]:  # the work ended before the cancellation took: its result goes (to a client that is gone)
        me.uncancel()
    return result
