"""A steady mix of streamed and whole requests against a router, each recorded with when it started and ended.

Used by the restart and stop drills (``test_restarts.py``, ``bench/fault_drill.py``). Every request has a client
timeout; one that reaches it is *hung*, which the drills must never see. A stream must end with its final chunk or
an error event: one that just stops is *silent*, a failure of the server, not a client error.
"""

from __future__ import annotations

import itertools
import json
import threading
import time
from dataclasses import dataclass

import httpx

KINDS = ("generate", "generate-stream", "chat", "chat-stream")


@dataclass
class Outcome:
    kind: str
    started: float  # time.monotonic()
    ended: float
    status: int  # HTTP status, or 0 when the client gave up (hung) or the connection broke
    result: str  # "ok", "error", "hung", "silent"
    detail: str = ""

    @property
    def seconds(self) -> float:
        return self.ended - self.started


def _body(kind: str, i: int, tokens: int, model: str) -> tuple[str, dict]:
    prompt = f"request {i}: " + "abc " * (i % 7)
    if kind.startswith("generate"):
        body = {"text": prompt, "stream": kind.endswith("stream"),
                "sampling_params": {"max_new_tokens": tokens, "temperature": 0, "ignore_eos": True}}
        return "/generate", body
    body = {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": tokens,
            "temperature": 0, "stream": kind.endswith("stream")}
    return "/v1/chat/completions", body


def _stream_result(lines) -> tuple[str, str]:
    """Read an SSE stream to its end: ok (a finish reason, then [DONE]), error (an error event) or silent."""
    finished = False
    for line in lines:
        if not line.startswith("data: "):
            continue
        data = line[6:]
        if data == "[DONE]":
            return ("ok", "") if finished else ("silent", "[DONE] without a finish reason")
        event = json.loads(data)
        if "error" in event:
            return "error", str(event["error"].get("message", event["error"]))[:200]
        meta = event.get("meta_info") or {}
        choices = event.get("choices") or [{}]
        if meta.get("finish_reason") or choices[0].get("finish_reason"):
            finished = True
    return "silent", "the stream ended without [DONE]"


def served_model(url: str) -> str:
    """The model id the server answers to (a chat request naming another one gets a 404)."""
    return httpx.get(url + "/v1/models", timeout=30).json()["data"][0]["id"]


def one_request(client: httpx.Client, url: str, kind: str, i: int, tokens: int, timeout: float,
                model: str) -> Outcome:
    path, body = _body(kind, i, tokens, model)
    started = time.monotonic()
    try:
        if body["stream"]:
            with client.stream("POST", url + path, json=body, timeout=timeout) as resp:
                if resp.status_code != 200:
                    resp.read()
                    return Outcome(kind, started, time.monotonic(), resp.status_code, "error", resp.text[:200])
                result, detail = _stream_result(resp.iter_lines())
                return Outcome(kind, started, time.monotonic(), 200, result, detail)
        resp = client.post(url + path, json=body, timeout=timeout)
        result = "ok" if resp.status_code == 200 else "error"
        return Outcome(kind, started, time.monotonic(), resp.status_code, result,
                       "" if result == "ok" else resp.text[:200])
    except httpx.TimeoutException as err:
        return Outcome(kind, started, time.monotonic(), 0, "hung", f"{type(err).__name__}")
    except httpx.HTTPError as err:  # a connection the server broke: an error, but one the client does see
        return Outcome(kind, started, time.monotonic(), 0, "error", f"{type(err).__name__}: {err}"[:200])


class LoadMix:
    """``workers`` threads, each sending one request after another (kinds in turn) until ``stop``."""

    def __init__(self, url: str, *, workers: int = 32, tokens: int = 6, timeout: float = 60.0):
        self.url, self.workers, self.tokens, self.timeout = url, workers, tokens, timeout
        self.model = served_model(url)
        self.outcomes: list[Outcome] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._numbers = itertools.count()
        self._running: dict[int, float] = {}  # worker -> when its current request started
        self._threads = [threading.Thread(target=self._run, args=(w,), daemon=True) for w in range(workers)]

    def __enter__(self) -> LoadMix:
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def _run(self, worker: int) -> None:
        with httpx.Client() as client:
            for turn in itertools.count(worker):
                if self._stop.is_set():
                    return
                i = next(self._numbers)
                with self._lock:
                    self._running[worker] = time.monotonic()
                outcome = one_request(client, self.url, KINDS[turn % len(KINDS)], i, self.tokens, self.timeout,
                                      self.model)
                with self._lock:
                    self.outcomes.append(outcome)
                    del self._running[worker]

    def stop(self) -> None:
        """Send no more; wait for the requests in flight (each ends by its client timeout at the latest)."""
        self._stop.set()
        for thread in self._threads:
            thread.join(self.timeout + 30)

    def snapshot(self) -> list[Outcome]:
        with self._lock:
            return list(self.outcomes)

    def running_since(self, at: float) -> int:
        """How many requests that started before ``at`` are still running."""
        with self._lock:
            return sum(started < at for started in self._running.values())

    def wait_ok(self, count: int, timeout: float) -> None:
        """Until ``count`` more requests succeeded than now."""
        want = sum(o.result == "ok" for o in self.snapshot()) + count
        deadline = time.monotonic() + timeout
        while sum(o.result == "ok" for o in self.snapshot()) < want:
            if time.monotonic() > deadline:
                raise AssertionError(f"fewer than {count} requests succeeded in {timeout}s: {self.summary()}")
            time.sleep(0.05)

    def summary(self, since: float | None = None) -> dict:
        done = [o for o in self.snapshot() if since is None or o.ended >= since]
        counts = {r: sum(o.result == r for o in done) for r in ("ok", "error", "hung", "silent")}
        return {**counts, "total": len(done)}
