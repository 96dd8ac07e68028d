"""Time to first token of a long prompt through PD, with and without chunk-by-chunk handoffs on the prefill node.

Starts two PD pairs behind the built-in router on 127.0.0.1 (SmolLM2 unless --model), both prefilling in chunks of
--chunk tokens: one hands each chunk's KV to the decode node while the next chunk computes (the default), the other
(`--disable-chunk-transfers`) after the last chunk, in one piece. Sends the same prompts of about --chunks chunks to
both, one request at a time, interleaved, and prints TTFT medians and their ratio (with / without: below 1 means the
overlap helps), and the median time from P's last chunk to D's scattered (the part the overlap can shorten). Both
pairs share this machine's cores with each other and with the client; only one is busy at a time.

    python bench/chunk_transfers.py [--model smollm2|tiny|PATH] [--chunk 256] [--chunks 4] [--runs 9] [--json]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
from pathlib import Path

import httpx
from serving import Servers, one_request

from fsm_pd.cli.launch import free_port
from fsm_pd.store import read_journal

WORDS = ["prefill", "decode", "chunk", "transfer", "page", "layer", "token", "cache", "router", "journal", "room"]


def prompt_of(tokens: int, seed: int) -> str:
    """About ``tokens`` tokens of distinct words (no two prompts share a prefix, so no cache helps either pair)."""
    rng = random.Random(seed)
    return f"{seed}: " + " ".join(rng.choice(WORDS) for _ in range(tokens))


def pair(servers: Servers, chunk: int, *extra: str) -> str:
    boot = free_port()
    prefill = servers.serve("prefill", "--bootstrap-port", str(boot), "--chunked-prefill-size", str(chunk),
                            "--disable-radix-cache", *extra)
    decode = servers.serve("decode")
    return servers.router(prefill, boot, decode)


def prompt_tokens(url: str, prompt: str) -> int:
    body = {"text": prompt, "sampling_params": {"max_new_tokens": 1, "temperature": 0}}
    answer = httpx.post(url + "/generate", json=body, timeout=600)
    answer.raise_for_status()
    return int(answer.json()["meta_info"]["prompt_tokens"])


def fit(url: str, chunk: int, chunks: int) -> int:
    """Words per prompt so that it takes ``chunks`` chunks, less a few tokens."""
    words = chunks * chunk // 8  # a word is at least one token (SmolLM2) and at most about 8 (the tiny model's bytes)
    for _ in range(4):
        got = prompt_tokens(url, prompt_of(words, -1))
        words = max(1, int(words * (chunks * chunk - 8) / got))
    return words


def handoff_tails(journals: list[Path]) -> dict[str, float]:
    """Median per pair of what follows the prompt's last chunk (same host, one clock): from P's last
    ``kv_ready``/``kv_chunk`` of a room to D's ``scattered``."""
    rows = [row for journal in journals for row in read_journal(journal)]
    last_chunk, scattered, chunked = {}, {}, set()
    for r in rows:
        if r.role == "prefill" and r.trigger in ("kv_ready", "kv_chunk") and r.dst == "Transferring":
            last_chunk[r.room] = max(last_chunk.get(r.room, 0.0), r.at)
            if r.trigger == "kv_chunk":
                chunked.add(r.room)
        elif r.role == "decode" and r.trigger == "scattered":
            scattered[r.room] = r.at
    tails: dict[str, list[float]] = {"chunk transfers": [], "whole handoff": []}
    for room, at in scattered.items():
        if room in last_chunk:
            tails["chunk transfers" if room in chunked else "whole handoff"].append(at - last_chunk[room])
    return {name: statistics.median(values) for name, values in tails.items() if values}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2", help="smollm2 (default), tiny, a .gguf file or an HF directory")
    parser.add_argument("--chunk", type=int, default=256, help="--chunked-prefill-size of both prefill nodes")
    parser.add_argument("--chunks", type=int, default=4, help="chunks per prompt")
    parser.add_argument("--runs", type=int, default=9)
    parser.add_argument("--max-new-tokens", type=int, default=4)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="fsm-pd-bench-") as tmp:
        servers = Servers(Path(tmp), args.model)
        try:
            urls = {"chunk transfers": pair(servers, args.chunk),
                    "whole handoff": pair(servers, args.chunk, "--disable-chunk-transfers")}
            words = fit(urls["whole handoff"], args.chunk, args.chunks)
            tokens = prompt_tokens(urls["whole handoff"], prompt_of(words, 0))
            for url in urls.values():  # warm both pairs on this prompt shape
                one_request(url, prompt_of(words, -2), args.max_new_tokens)
            ttft: dict[str, list[float]] = {name: [] for name in urls}
            for run in range(args.runs):
                order = list(urls.items()) if run % 2 == 0 else list(urls.items())[::-1]
                for name, url in order:
                    ttft[name].append(one_request(url, prompt_of(words, run + 1), args.max_new_tokens)["ttft"])
        finally:
            servers.stop()
        tails = handoff_tails(sorted(Path(tmp).glob("*.db")))
    medians = {name: statistics.median(values) for name, values in ttft.items()}
    ratio = medians["chunk transfers"] / medians["whole handoff"]
    result = {"model": args.model, "chunk": args.chunk, "prompt_tokens": tokens, "runs": args.runs,
              "ttft_median_ms": {n: round(m * 1e3, 1) for n, m in medians.items()},
              "ttft_ms": {n: [round(v * 1e3, 1) for v in vs] for n, vs in ttft.items()},
              "ratio_with_over_without": round(ratio, 3),
              "after_last_chunk_median_ms": {n: round(t * 1e3, 1) for n, t in tails.items()}}
    if args.json:
        print(json.dumps(result))
        return 0
    print(f"{args.model}: prompt of {tokens} tokens in chunks of {args.chunk}, {args.runs} runs each, interleaved")
    for name, median in medians.items():
        spread = f"{min(ttft[name]) * 1e3:.1f}-{max(ttft[name]) * 1e3:.1f}"
        tail = f"{tails[name] * 1e3:.1f} ms" if name in tails else "?"
        print(f"  {name:16s} TTFT median {median * 1e3:8.1f} ms  (min-max {spread} ms); after the last chunk, to D's "
              f"scattered: {tail}")
    print(f"  ratio chunk transfers / whole handoff: {ratio:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
