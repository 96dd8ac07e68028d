"""A router request whose client leaves while the router winds down a failed attempt ends there: the cancellation
reaches it even while it waits for a leg's call to end, and no retry is sent for a client that is gone. The router
runs in process; its workers are an ``httpx.MockTransport`` that scripts each worker's answer."""

from __future__ import annotations

import asyncio

import httpx

from fsm_pd.router.core import PDRouter, PrefillWorker
from fsm_pd.router.policy import CLASSIC_PD


class LeavingClient:
    """The ASGI request as ``dispatch`` reads it: the client disconnects once ``gone`` is set."""

    headers: dict = {}

    def __init__(self, gone: asyncio.Event):
        self.gone = gone

    async def receive(self) -> dict:
        await self.gone.wait()
        return {"type": "http.disconnect"}


async def quiescent(keep: set[asyncio.Future]) -> None:
    """Until no task but ``keep`` is left in the loop: then nothing the request started can still send a retry (a
    retry is sent by a task: the request's own or one of its legs')."""
    while others := asyncio.all_tasks() - keep:
        await asyncio.wait(others)


def test_a_client_leaving_during_the_wind_down_cancels_the_request_and_gets_no_retry():
    async def scenario() -> tuple[int, list[str]]:
        closing, release = asyncio.Event(), asyncio.Event()
        ours = asyncio.all_tasks()  # this scenario and the task that runs it
        generate_calls: list[str] = []

        async def workers(request: httpx.Request) -> httpx.Response:
            host, path = request.url.host, request.url.path
            if path == "/health":
                return httpx.Response(200, json={})
            if path == "/abort_request":
                return httpx.Response(200, json={"aborted": []})
            generate_calls.append(host)
            if host == "p0":  # refuses at once, as a draining node does: the attempt is retried
                return httpx.Response(503, json={"error": {"message": "draining", "type": "x", "code": 503}})
            if host == "d0" and generate_calls.count("d0") == 1:
                try:
                    await asyncio.Event().wait()
                except asyncio.CancelledError:  # the router closes this leg: its call takes a while to end
                    closing.set()  # and meanwhile the client goes away
                    await release.wait()
                    raise
            return httpx.Response(200, json={"text": "x", "output_ids": [1], "meta_info": {}})

        router = PDRouter([PrefillWorker("http://p0", 8998), PrefillWorker("http://p1", 8998)], ["http://d0"],
                          policy="round_robin", health_interval_s=60, pd_policy=CLASSIC_PD)
        router._client = httpx.AsyncClient(transport=httpx.MockTransport(workers))
        try:
            response = await router.dispatch("/generate", {"text": "hi", "rid": "gone-1"}, LeavingClient(closing))
            # Only now may d0's call end: a router that ran on after the client left would retry once it has.
            release.set()
            await quiescent({*ours, router._health_task})  # the request's tasks all ended: no retry can still come
            return response.status_code, list(generate_calls)
        finally:
            release.set()
            router._health_task.cancel()
            await router.client.aclose()

    status, calls = asyncio.run(asyncio.wait_for(scenario(), 30))
    assert status == 499
    assert sorted(calls) == ["d0", "p0"], calls  # the first attempt only: p1 never got the retry, not even later


def test_a_request_is_served_in_the_task_that_dispatched_it():
    """No task of its own for the request: each task handed over is a turn of the event loop before the client hears
    of its answer (``PDRouter.dispatch``)."""

    async def scenario() -> tuple[asyncio.Task, asyncio.Task | None]:
        router = PDRouter([PrefillWorker("http://p0", 8998)], ["http://d0"], policy="round_robin",
                          health_interval_s=60, pd_policy=CLASSIC_PD)
        served_in: list[asyncio.Task | None] = []

        async def serve(path, body, request):
            served_in.append(asyncio.current_task())
            return httpx.Response(200)

        router._serve = serve
        try:
            await router.dispatch("/generate", {"text": "hi", "rid": "here-1"}, LeavingClient(asyncio.Event()))
            return asyncio.current_task(), served_in[0]
        finally:
            router._health_task.cancel()
            await router.client.aclose()

    mine, served = asyncio.run(asyncio.wait_for(scenario(), 30))
    assert served is mine
