"""What a streamed token costs the event loop while its reader waits: ``RequestRun.next_output`` (the API's own
code) reading a request whose engine pushes one token at a time, each after the reader began to wait, as a decode
loop of one step a dispatch does under load. Prints the median microseconds a token over --runs runs of --tokens
tokens, on one event loop and nothing else.

    python bench/token_wait.py [--tokens 20000] [--runs 5]

To compare two commits, run it with ``PYTHONPATH`` at a checkout of each (``git worktree add /tmp/old REV``), back
to back: the figure is the code's alone, and moves with the machine's load.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time

from fsm_pd.api.runner import RequestRun
from fsm_pd.model.sampling import SamplingParams
from fsm_pd.model.tokenizer import ByteTokenizer
from fsm_pd.serving.types import GenerateRequest, RequestStream, TokenOutput


class OneAtATime:
    """An engine that gives its request a token each time ``release`` is called: the token lands on the loop's next
    turns, so the reader, which asks right after the release, is always waiting for it."""

    role, model_name, max_context = "colocated", "token-wait", 1 << 30

    def __init__(self, tokens: int):
        self.tokens, self.sent, self.stream = tokens, 0, None

    def submit(self, request: GenerateRequest, stream: RequestStream) -> None:
        self.stream = stream

    def release(self) -> None:
        last = self.sent == self.tokens - 1
        output = TokenOutput(65 + self.sent % 26, finish_reason={"type": "length"} if last else None)
        self.sent += 1
        asyncio.get_running_loop().call_soon(self.stream.push, output)  # as the model thread's push lands

    def abort(self, rid, reason=None, status=499, *, room=None) -> bool:
        return False


async def one_run(tokens: int) -> float:
    request = GenerateRequest("w", [1, 2, 3], SamplingParams(max_new_tokens=tokens), seed=0, stream=True)
    engine = OneAtATime(tokens)
    run = RequestRun(engine, request, ByteTokenizer(vocab_size=272), None)
    began = time.perf_counter()
    got = 0
    while engine.sent < tokens:
        engine.release()
        assert await run.next_output() is not None
        got += 1
    assert got == tokens and await run.next_output() is None
    return (time.perf_counter() - began) / tokens * 1e6


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=20_000)
    parser.add_argument("--runs", type=int, default=5)
    args = parser.parse_args(argv)
    each = [asyncio.run(one_run(args.tokens)) for _ in range(args.runs)]
    print(f"next_output: {statistics.median(each):.1f} us a token (median of {args.runs} runs of {args.tokens}; "
          f"each {', '.join(f'{x:.1f}' for x in each)})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
