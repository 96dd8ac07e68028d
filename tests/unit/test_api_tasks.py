"""``cancel_and_wait``: a task's error is logged, the caller's own cancellation propagates (``api/tasks.py``)."""

from __future__ import annotations

import asyncio
import logging

import pytest

from fsm_pd.api.tasks import cancel_and_wait


def warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "fsm_pd.api.tasks" and r.levelno == logging.WARNING]


def test_an_error_a_cancelled_task_ends_with_is_logged_and_a_plain_cancellation_is_not(caplog):
    async def fails_when_cancelled():
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            raise RuntimeError("cleanup broke") from None

    async def scenario():
        broken, plain = asyncio.ensure_future(fails_when_cancelled()), asyncio.ensure_future(asyncio.sleep(60))
        await asyncio.sleep(0)
        await cancel_and_wait(broken, plain, what="the broken task")
        assert broken.done() and plain.cancelled()

    asyncio.run(scenario())
    assert warnings(caplog) == ["the broken task ended with RuntimeError: cleanup broke"]


def test_expected_errors_are_not_logged(caplog):
    async def ends_with(err):
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            raise err from None

    async def scenario():
        task = asyncio.ensure_future(ends_with(StopAsyncIteration()))
        await asyncio.sleep(0)
        await cancel_and_wait(task, what="a read", expected=(StopAsyncIteration,))

    asyncio.run(scenario())
    assert warnings(caplog) == []


def test_a_caller_cancelled_while_it_waits_gets_its_cancelled_error_and_the_task_is_still_heard(caplog):
    async def scenario():
        slow_to_end, cleaning_up = asyncio.Event(), asyncio.Event()

        async def stubborn():
            try:
                await asyncio.Event().wait()
            except asyncio.CancelledError:
                cleaning_up.set()
                await slow_to_end.wait()  # a cleanup that takes a while once cancelled
                raise RuntimeError("and then failed") from None

        task = asyncio.ensure_future(stubborn())
        await asyncio.sleep(0)
        caller = asyncio.ensure_future(cancel_and_wait(task, what="the stubborn task"))
        await cleaning_up.wait()  # the caller cancelled the task, and it runs its cleanup: the caller waits for it
        assert not caller.done()
        caller.cancel()
        with pytest.raises(asyncio.CancelledError):
            await caller
        assert not task.done()
        slow_to_end.set()
        await asyncio.wait({task})
        await asyncio.sleep(0)  # its done callback runs

    asyncio.run(scenario())
    assert warnings(caplog) == ["the stubborn task ended with RuntimeError: and then failed"]
