"""An oversized request beside a stream: how fast the server refuses it, and what it costs the stream (issue 51).

Against a running server (a node, the built-in router, ``--role pd``; TCP or a unix socket, as on a TPU host):

1. baseline: one greedy ``/generate`` stream of --tokens tokens alone: its median and longest gap between chunks;
2. the same stream with a body of --bytes bytes (a valid JSON document: one long text, what a node would parse and
   tokenize) sent beside it after its third chunk, the way a client that does not wait sends it: the answer's
   status and how long it took, and the stream's gaps, each against the baseline's;
3. the next request's status.

    fsm-pd serve --role pd --uds /tmp/pd.sock &        # or any server; wait for its /health
    python bench/oversized.py --url unix:/tmp/pd.sock [--bytes 20000000] [--tokens 300] [--json]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import select
import socket
import statistics
import threading
import time

from fsm_pd.net import unix_http
from fsm_pd.net.unix_sockets import is_unix, unix_path


def connect(url: str) -> socket.socket:
    if is_unix(url):
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.connect(unix_path(url))
        return sock
    host, port = url.removeprefix("http://").rsplit(":", 1)
    return socket.create_connection((host.strip("[]"), int(port)))


def post_big(url: str, total: int, *, chunked: bool = False) -> int:
    """POST a /generate body of ``total`` bytes (``{"text": "aaa..."}``) on a raw socket, writing until the answer
    is readable (an HTTP library still writing often sees the server's reset instead of its early answer); the
    answer's status."""
    head, tail = b'{"text": "', b'"}'
    framing = "Transfer-Encoding: chunked" if chunked else f"Content-Length: {total}"
    with connect(url) as sock:
        sock.settimeout(60)
        sock.sendall(f"POST /generate HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n{framing}"
                     "\r\n\r\n".encode())
        sent, piece = 0, b"a" * 65536
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            while sent < total and not select.select([sock], [], [], 0)[0]:
                chunk = (head + piece[len(head):] if sent == 0 else piece)[: total - sent]
                if sent + len(chunk) == total:
                    chunk = chunk[: -len(tail)] + tail
                sock.sendall(b"%x\r\n%s\r\n" % (len(chunk), chunk) if chunked else chunk)
                sent += len(chunk)
            if chunked and sent >= total:
                sock.sendall(b"0\r\n\r\n")
        answer = b""
        while b"\r\n" not in answer:
            data = sock.recv(4096)
            if not data:
                break
            answer += data
    return int(answer.split(b" ", 2)[1])


class Stream(threading.Thread):
    """One greedy /generate stream of ``tokens`` tokens; when each chunk came, and how many tokens it ended with."""

    def __init__(self, url: str, tokens: int) -> None:
        super().__init__(daemon=True)
        self.url, self.tokens, self.arrivals, self.got = url, tokens, [], 0
        self.third = threading.Event()

    def run(self) -> None:
        body = {"text": "Once upon a time", "stream": True,
                "sampling_params": {"max_new_tokens": self.tokens, "temperature": 0, "ignore_eos": True}}
        try:
            with unix_http.client(timeout=300) as client, client.stream(
                    "POST", unix_http.http_url(self.url) + "/generate", json=body) as answer:
                for line in answer.iter_lines():
                    if line.startswith("data:") and line != "data: [DONE]":
                        self.arrivals.append(time.monotonic())
                        self.got = len(json.loads(line.removeprefix("data:")).get("output_ids", ()))
                        if len(self.arrivals) == 3:
                            self.third.set()
        finally:
            self.third.set()

    def gaps_ms(self) -> tuple[float, float]:
        gaps = [(b - a) * 1000 for a, b in zip(self.arrivals[1:], self.arrivals[2:], strict=False)]  # after the 1st
        return statistics.median(gaps), max(gaps)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", required=True, help="http://HOST:PORT or unix:PATH")
    parser.add_argument("--bytes", type=int, default=20_000_000)
    parser.add_argument("--tokens", type=int, default=300)
    parser.add_argument("--chunked", action="store_true", help="send the body chunked instead of with its length")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()

    alone = Stream(args.url, args.tokens)
    alone.run()
    beside = Stream(args.url, args.tokens)
    beside.start()
    beside.third.wait(300)
    began = time.monotonic()
    status = post_big(args.url, args.bytes, chunked=args.chunked)
    took_ms = (time.monotonic() - began) * 1000
    beside.join(300)
    with unix_http.client(timeout=120) as client:
        after = client.post(unix_http.http_url(args.url) + "/generate",
                            json={"text": "Hi", "sampling_params": {"max_new_tokens": 4}}).status_code
    (base_median, base_longest), (median, longest) = alone.gaps_ms(), beside.gaps_ms()
    result = {"url": args.url, "bytes": args.bytes, "status": status, "answered_ms": round(took_ms, 1),
              "baseline_gap_ms": {"median": round(base_median, 1), "longest": round(base_longest, 1)},
              "gap_ms": {"median": round(median, 1), "longest": round(longest, 1)},
              "longest_gap_ratio": round(longest / base_longest, 2), "stream_tokens": beside.got,
              "next_request_status": after}
    if args.json:
        print(json.dumps(result))
        return
    print(f"{args.bytes} bytes to {args.url}: {status} in {took_ms:.1f} ms; next request {after}")
    print(f"stream alone:      median gap {base_median:.1f} ms, longest {base_longest:.1f} ms")
    print(f"stream beside it:  median gap {median:.1f} ms, longest {longest:.1f} ms "
          f"({longest / base_longest:.2f}x the baseline's longest), {beside.got} of {args.tokens} tokens")


if __name__ == "__main__":
    main()
