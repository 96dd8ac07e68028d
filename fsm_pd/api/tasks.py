"""Ending tasks we no longer need: cancel them, wait for them, and hear how they ended.

``contextlib.suppress(BaseException)`` around awaiting a cancelled task hid two things: an error the task ended
with, and the caller's own cancellation arriving while it waited, after which the caller ran on as if it had not been
cancelled (a router request whose client had left went on to its retry). ``cancel_and_wait`` keeps both.
"""

from __future__ import annotations

import asyncio
import logging
from functools import partial

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
