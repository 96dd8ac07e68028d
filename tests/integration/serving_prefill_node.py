"""A ``PrefillEngine`` in its own process, for the two-process serving test.

Prints one JSON line with its bootstrap host and port, then reads requests as JSON lines on stdin
(``{"rid", "input_ids", "room", "max_new_tokens"}``) and answers each with a JSON line once the prefill node is done
with it (``{"rid", "token_id"}`` or ``{"rid", "error", "status"}``). An empty line or EOF stops it.
"""

from __future__ import annotations

import asyncio
import json
import sys

from fsm_pd.model.sampling import SamplingParams
from fsm_pd.serving.collect import generate
from fsm_pd.serving.prefill_engine import PrefillEngine
from fsm_pd.serving.types import Bootstrap, EngineError, GenerateRequest
from fsm_pd.transport import secret_from_env


def answer(obj: dict) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


async def serve(engine: PrefillEngine) -> None:
    host, port = engine.bootstrap_host_port
    answer({"bootstrap_host": host, "bootstrap_port": port})
    loop = asyncio.get_running_loop()
    tasks = set()

    async def one(cmd: dict) -> None:
        request = GenerateRequest(
            cmd["rid"],
            cmd["input_ids"],
            SamplingParams(temperature=0.0, max_new_tokens=cmd["max_new_tokens"]),
            seed=0,
            bootstrap=Bootstrap(host, port, cmd["room"]),
        )
        try:
            (out,) = await generate(engine, request)
            answer({"rid": request.rid, "token_id": out.token_id})
        except EngineError as exc:
            answer({"rid": request.rid, "error": str(exc), "status": exc.status})

    while line := (await loop.run_in_executor(None, sys.stdin.readline)).strip():
        task = asyncio.ensure_future(one(json.loads(line)))
        tasks.add(task)
        task.add_done_callback(tasks.discard)
    await asyncio.gather(*tasks)


def main() -> None:
    num_pages, page_size = int(sys.argv[1]), int(sys.argv[2])
    engine = PrefillEngine(
        "tiny",
        num_pages=num_pages,
        page_size=page_size,
        node_id="prefill-proc",
        secret=secret_from_env(),
        backend="zmq",
    )
    try:
        asyncio.run(serve(engine))
    finally:
        engine.close()


if __name__ == "__main__":
    main()
