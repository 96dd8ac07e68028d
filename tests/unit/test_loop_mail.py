"""Calls posted to an event loop from other threads run there in order, with one wake of the loop while one is on
its way (``serving/loop_mail.py``): a step's tokens for many streams cost the model thread one hand-over of the
interpreter's lock, not one a stream."""

from __future__ import annotations

import asyncio
import threading

import pytest

from fsm_pd.serving.loop_mail import mail_for
from fsm_pd.serving.types import RequestStream, TokenOutput


def test_posts_from_a_thread_run_in_order_with_one_wake():
    async def main():
        loop = asyncio.get_running_loop()
        mail, seen = mail_for(loop), []
        wakes_before = mail.wakes

        def post_many():
            for i in range(100):
                mail.post(seen.append, i)

        thread = threading.Thread(target=post_many)
        thread.start()
        thread.join()  # the loop ran nothing meanwhile: all 100 ride on the first wake
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        assert seen == list(range(100))
        assert mail.wakes - wakes_before == 1
        mail.post(seen.append, 100)  # drained: the next post wakes again
        await asyncio.sleep(0)
        assert seen[-1] == 100 and mail.wakes - wakes_before == 2

    asyncio.run(main())


def test_a_failing_call_does_not_hold_back_the_others():
    async def main():
        loop = asyncio.get_running_loop()
        errors, seen = [], []
        loop.set_exception_handler(lambda _loop, context: errors.append(context["exception"]))
        mail = mail_for(loop)

        def boom(_):
            raise ValueError("a stream's callback failed")

        threading.Thread(target=lambda: (mail.post(boom, 0), mail.post(seen.append, 1))).start()
        for _ in range(100):
            await asyncio.sleep(0.001)
            if seen:
                break
        assert seen == [1]
        assert [str(e) for e in errors] == ["a stream's callback failed"]

    asyncio.run(main())


def test_streams_of_one_loop_share_its_mail_and_keep_each_ones_order():
    async def main():
        loop = asyncio.get_running_loop()
        streams = [RequestStream(f"r{i}") for i in range(8)]
        mail = mail_for(loop)
        wakes_before = mail.wakes

        def model_step():
            for step in range(3):
                for stream in streams:
                    stream.push(TokenOutput(token_id=step, finish_reason={"type": "length"} if step == 2 else None))

        thread = threading.Thread(target=model_step)
        thread.start()
        thread.join()
        outs = [[t.token_id async for t in stream] for stream in streams]
        assert outs == [[0, 1, 2]] * 8
        assert mail.wakes - wakes_before == 1

    asyncio.run(main())


def test_a_closed_loop_refuses_as_call_soon_threadsafe_does():
    loop = asyncio.new_event_loop()
    mail = mail_for(loop)
    loop.close()
    with pytest.raises(RuntimeError):
        mail.post(print, "nobody reads this")
    stream = RequestStream("r", loop=loop)  # a stream of a stopped server: its push is dropped, not raised
    stream.push(TokenOutput(token_id=1))
