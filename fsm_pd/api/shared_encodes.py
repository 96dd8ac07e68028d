"""``SharedEncodes``: one tokenizer for the two engine apps of ``fsm-pd serve --role pd``, which encodes a text once.

The built-in router sends each PD request to both engines of the process, and each engine's app renders and tokenizes
the same prompt (``api/requests.py``, ``build_plan``): twice the tokenizer's work per request, on worker threads that
contend with the model thread and the event loop for the interpreter's lock. SmolLM2's tokenizer takes ~3 ms for a
900-token prompt on a CPU core, so a burst of 16 such prompts spent ~50 ms more than a colocated node's one pass.

Whichever leg encodes a text first computes its ids; the other leg, with the same text and options, takes a copy
(the encode is deterministic, so this is a cache, whatever pairs the two calls). A second call that arrives while the
first is still encoding waits for it instead of starting its own. An entry is dropped once taken a second time; at
most ``size`` are kept (a request the router served on one engine alone, ``--pd-policy auto``'s local path, leaves
one behind until newer texts push it out).

Thread-safe: the plans are built on worker threads (``build_plan``).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Any

DEFAULT_SIZE = 64  # texts kept: a burst's worth of requests whose second leg has not planned yet


class _Entry:
    __slots__ = ("done", "ids", "takers")

    def __init__(self) -> None:
        self.done = threading.Event()
        self.ids: list[int] | None = None  # None once done: the encode failed (the waiter encodes itself)
        self.takers = 1


class SharedEncodes:
    def __init__(self, tokenizer: Any, size: int = DEFAULT_SIZE) -> None:
        self._inner, self._size = tokenizer, size
        self._entries: OrderedDict[tuple, _Entry] = OrderedDict()
        self._lock = threading.Lock()
        self.encodes = 0  # how many texts the inner tokenizer encoded (the tests count them)

    def encode(self, text: str, **options: Any) -> list[int]:
        key = (text, tuple(sorted(options.items())))
        with self._lock:
            entry, first = self._entries.get(key), False
            if entry is not None:
                entry.takers += 1
                if entry.takers >= 2:  # both legs have it now
                    del self._entries[key]
            else:
                entry, first = _Entry(), True
                self._entries[key] = entry
                while len(self._entries) > self._size:
                    self._entries.popitem(last=False)
        if first:  # encoded outside the lock: other texts' encodes go on meanwhile
            return self._encode(entry, text, options)
        entry.done.wait()
        if entry.ids is None:  # the first encode failed: this one raises its own error, or succeeds
            return self._count(text, options)
        return list(entry.ids)  # a copy: each leg's request owns its list

    def _encode(self, entry: _Entry, text: str, options: dict) -> list[int]:
        try:
            ids = self._count(text, options)
            entry.ids = list(ids)
            return ids
        finally:
            entry.done.set()

    def _count(self, text: str, options: dict) -> list[int]:
        self.encodes += 1
        return self._inner.encode(text, **options)

    def __getattr__(self, name: str) -> Any:  # decode, chat_template, vocab_size, max_token_bytes...
        return getattr(self._inner, name)
