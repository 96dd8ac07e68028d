"""What a failed KV transfer costs when the decode node recomputes the prompt (``--on-transfer-failure recompute``)
against a normal transfer, in the same run: a prefill engine and a decode engine in one process (the production
engines, tcp transfers over 127.0.0.1, their real side channel and bootstrap server), one request at a time.

For each prompt length, ``--requests`` requests go through the pair as a router sends them (both engines at once);
per request: the time from submit to the decode node's first token (TTFT: prefill + transfer, or prefill + failed
pull + recompute) and to its last. Then the same with every pull failing (fault injection on the decode node,
``FSM_PD_FAULT_PULL=1``'s hook). Prints medians and the recompute/normal ratio; checks every recomputed answer
equals the normal one (greedy).

    python bench/recompute.py [--model tiny|smollm2|PATH] [--lengths 16 128 512] [--requests 10]
                              [--max-new-tokens 16] [--json]
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import itertools
import json
import logging
import statistics
import tempfile
import time
from pathlib import Path

from fsm_pd.effects.faults import FaultConfig, Faults
from fsm_pd.model.loader import load_model
from fsm_pd.model.sampling import SamplingParams
from fsm_pd.serving.decode_engine import DecodeEngine
from fsm_pd.serving.prefill_engine import PrefillEngine
from fsm_pd.serving.types import Bootstrap, GenerateRequest, RequestStream

rooms = itertools.count(1)


async def one(p: PrefillEngine, d: DecodeEngine, ids: list[int], tokens: int) -> tuple[float, float, list[int]]:
    host, port = p.bootstrap_host_port
    request = GenerateRequest(f"r{next(rooms)}", ids, SamplingParams(temperature=0.0, max_new_tokens=tokens,
                                                                      ignore_eos=True), seed=0)
    request = dataclasses.replace(request, bootstrap=Bootstrap(host, port, next(rooms)))
    started = time.perf_counter()
    p_stream, d_stream = RequestStream(request.rid + "p"), RequestStream(request.rid + "d")
    p.submit(dataclasses.replace(request, rid=request.rid + "p"), p_stream)
    d.submit(dataclasses.replace(request, rid=request.rid + "d"), d_stream)

    async def drain_prefill():
        return [out async for out in p_stream]

    prefill = asyncio.ensure_future(drain_prefill())
    first, out_ids = None, []
    async for out in d_stream:
        first = first if first is not None else time.perf_counter() - started
        out_ids.append(out.token_id)
    await prefill
    return first, time.perf_counter() - started, out_ids


def fail_pulls(d: DecodeEngine, on: bool) -> None:
    d.manager.effects.faults = Faults(FaultConfig(stages={"pull": 1.0} if on else {}), role="decode")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--lengths", type=int, nargs="+", default=[16, 128, 512])
    parser.add_argument("--requests", type=int, default=10)
    parser.add_argument("--max-new-tokens", type=int, default=16)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    logging.basicConfig(level=logging.ERROR)  # every failed room logs a line here: on purpose, and many
    model = load_model(args.model)
    tmp = Path(tempfile.mkdtemp(prefix="fsm-pd-recompute-"))
    pages = max(64, 4 * (max(args.lengths) + args.max_new_tokens) // 16 + 8)
    p = PrefillEngine(model, num_pages=pages, page_size=16, backend="tcp", journal=str(tmp / "p.db"))
    d = DecodeEngine(model, num_pages=pages, page_size=16, backend="tcp", secret=p.secret,
                     journal=str(tmp / "d.db"), on_transfer_failure="recompute")
    rows = []
    try:
        for length in args.lengths:
            ids = [(7 * i) % (model.config.vocab_size - 2) + 1 for i in range(length)]
            figures = {}
            answers = {}
            for mode in ("normal", "recompute"):
                fail_pulls(d, mode == "recompute")
                asyncio.run(one(p, d, ids, args.max_new_tokens))  # warm: compiles this length's programs
                runs = [asyncio.run(one(p, d, ids, args.max_new_tokens)) for _ in range(args.requests)]
                figures[mode] = (statistics.median(r[0] for r in runs), statistics.median(r[1] for r in runs))
                answers[mode] = {tuple(r[2]) for r in runs}
            fail_pulls(d, False)
            assert answers["normal"] == answers["recompute"] and len(answers["normal"]) == 1, "outputs differ"
            rows.append({"prompt_tokens": length, "ttft_normal_s": figures["normal"][0],
                         "ttft_recompute_s": figures["recompute"][0],
                         "ttft_ratio": figures["recompute"][0] / figures["normal"][0],
                         "e2e_normal_s": figures["normal"][1], "e2e_recompute_s": figures["recompute"][1],
                         "e2e_ratio": figures["recompute"][1] / figures["normal"][1]})
    finally:
        d.close()
        p.close()
    if args.json:
        print(json.dumps({"model": args.model, "max_new_tokens": args.max_new_tokens, "requests": args.requests,
                          "rows": rows}, indent=2))
        return
    print(f"model {args.model}, {args.max_new_tokens} new tokens, median of {args.requests} requests each "
          f"(one at a time); recomputed answers equal the normal ones")
    print(f"{'prompt':>7} {'TTFT normal':>12} {'TTFT recompute':>15} {'ratio':>6} {'e2e normal':>11} "
          f"{'e2e recompute':>14} {'ratio':>6}")
    for r in rows:
        print(f"{r['prompt_tokens']:>7} {r['ttft_normal_s'] * 1e3:>10.1f}ms {r['ttft_recompute_s'] * 1e3:>13.1f}ms "
              f"{r['ttft_ratio']:>6.2f} {r['e2e_normal_s'] * 1e3:>9.1f}ms {r['e2e_recompute_s'] * 1e3:>12.1f}ms "
              f"{r['e2e_ratio']:>6.2f}")


if __name__ == "__main__":
    main()
