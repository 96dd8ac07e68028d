"""Where a request is planned (``api/requests.build_plan``): a body of at most ``INLINE_PLAN_BYTES`` on the event loop
(the hop to a worker thread and back cost more than its planning), a bigger one, or one without a Content-Length,
on a worker thread, so that the event loop's streams never wait for a long prompt's tokenizing."""

from __future__ import annotations

import asyncio
import threading

import pytest

from fsm_pd.api.requests import INLINE_PLAN_BYTES, build_plan


class Request:
    def __init__(self, length: str | None):
        self.headers = {} if length is None else {"content-length": length}


@pytest.mark.parametrize(("length", "inline"), [(str(INLINE_PLAN_BYTES), True), ("300", True),
                                                 (str(INLINE_PLAN_BYTES + 1), False), (None, False)])
def test_a_small_body_is_planned_on_the_event_loop_and_a_big_one_on_a_worker(length, inline):
    async def planned_on() -> tuple[threading.Thread, threading.Thread]:
        plan = await build_plan(lambda node, tokenizer, body: threading.current_thread(), None, None, None,
                                Request(length))
        return plan, threading.current_thread()

    plan_thread, loop_thread = asyncio.run(planned_on())
    assert (plan_thread is loop_thread) == inline
