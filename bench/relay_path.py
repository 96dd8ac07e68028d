"""The router's CPU time a streamed chunk, for a decode engine of its own process (``--role pd``): the pass-through
(``router/passthrough.py``: the engine's app awaits the client's ``send``) against ``legs.relay`` (a queue, httpx's
body iterator, ``until``'s timeout context a chunk, the router's ``StreamingResponse``), measured in the same run.

The router app is the production one (``create_router_app`` with ``local_apps``, ``--pd-policy never``,
``migrate=False``, as ``serve_pd`` builds it). The engine is a stand-in ASGI app that sends a chat stream's events as
fast as the loop lets it, so the figure is the router's share alone (the engine's own app stack and model are not
in it); the client is an ASGI ``send`` that counts events, so no socket either. The relay rows hide the transport's
``PASS_TO`` from the router (the path a worker on a socket takes). CPU time (``time.process_time``), the best of
--rounds rounds of --streams concurrent streams, twice each path, alternating: on a shared machine the wall clock
says little, a process's CPU time a chunk much more.

    python bench/relay_path.py [--chunks 500] [--streams 16] [--rounds 3]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import socket
import tempfile
import time
from unittest import mock

import fsm_pd.router.core as core
from fsm_pd.router import create_router_app
from fsm_pd.router.app import PrefillWorker, RetrySettings
from fsm_pd.router.policy import PolicySettings

EVENT = (b'data: {"id":"c","object":"chat.completion.chunk","choices":[{"index":0,"delta":{"content":" 7"},'
         b'"finish_reason":null}]}\n\n')


def engine(chunks: int):
    async def app(scope, receive, send) -> None:
        if scope["path"] == "/health":
            await send({"type": "http.response.start", "status": 200, "headers": []})
            await send({"type": "http.response.body", "body": b"{}"})
            return
        await receive()
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"text/event-stream")]})
        for i in range(chunks):
            await send({"type": "http.response.body", "body": EVENT, "more_body": True})
            if i % 4 == 3:
                await asyncio.sleep(0)  # an engine's stream waits for its next tokens now and then
        await send({"type": "http.response.body", "body": b"data: [DONE]\n\n", "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})
    return app


def router(tmp: str, app):
    apps, paths = {}, {}
    for role in ("prefill", "decode"):
        path = paths[role] = os.path.join(tmp, f"{role}.sock")
        socket.socket(socket.AF_UNIX).bind(path)  # the file the router's transport finds, never connected to
        apps[path] = app
    return create_router_app([PrefillWorker(f"unix:{paths['prefill']}", f"unix:{os.path.join(tmp, 'b.sock')}")],
                             [f"unix:{paths['decode']}"], local_apps=apps, pd_policy=PolicySettings("never"),
                             retry=RetrySettings(migrate=False))


async def one_stream(app) -> int:
    body = json.dumps({"messages": [{"role": "user", "content": "hi"}], "stream": True}).encode()
    scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
             "method": "POST", "scheme": "http", "path": "/v1/chat/completions", "raw_path": b"/v1/chat/completions",
             "query_string": b"", "root_path": "", "headers": [(b"content-type", b"application/json")],
             "client": ("127.0.0.1", 1), "server": ("localhost", 80), "state": {}}
    asked, done, events = False, asyncio.Event(), 0

    async def receive() -> dict:
        nonlocal asked
        if not asked:
            asked = True
            return {"type": "http.request", "body": body, "more_body": False}
        await done.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        nonlocal events
        if message["type"] == "http.response.body":
            events += message.get("body", b"").count(b"data: {")

    await app(scope, receive, send)
    done.set()
    return events


MIN_CPU_S = 0.05  # a round repeats its streams until it used this much CPU: some hosts' process clock ticks coarsely


async def cpu_a_chunk(app, streams: int, rounds: int) -> float:
    """Microseconds of CPU a chunk, the best of ``rounds``. A round sends ``streams`` streams at a time, again until
    its CPU time reads at least ``MIN_CPU_S``: on the TPU host a quick run's streams took less than the process
    clock's tick, and a round read 0 s."""
    await one_stream(app)  # warm: the health checks' first round, the first request
    best = float("inf")
    for _ in range(rounds):
        started, chunks = time.process_time(), 0
        while (used := time.process_time() - started) < MIN_CPU_S or not chunks:
            chunks += sum(await asyncio.gather(*(one_stream(app) for _ in range(streams))))
        best = min(best, used / chunks * 1e6)
    return best


async def main(args: argparse.Namespace) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        app = router(tmp, engine(args.chunks))
        figures: dict[str, list[float]] = {"relay": [], "passthrough": []}
        for path in ("relay", "passthrough") * 2:
            hidden = mock.patch.object(core, "PASS_TO", "hidden") if path == "relay" else contextlib.nullcontext()
            with hidden:
                us = await cpu_a_chunk(app, args.streams, args.rounds)
            figures[path].append(us)
            print(f"{path:12s} {us:6.1f} us CPU a chunk ({args.streams} streams of {args.chunks} chunks)")
        relay, through = min(figures["relay"]), min(figures["passthrough"])
        print(f"passthrough / relay: {through / relay:.2f}x the router's CPU a chunk ({relay - through:.1f} us less)")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--chunks", type=int, default=500, help="events a stream (default 500)")
    parser.add_argument("--streams", type=int, default=16, help="streams at a time (default 16)")
    parser.add_argument("--rounds", type=int, default=3, help="rounds a path, the best kept (default 3)")
    asyncio.run(main(parser.parse_args()))
