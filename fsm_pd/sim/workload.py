"""Prompts that share prefixes, as a chat service's do: so the prefix caches hit, evict and lock.

Each prompt of the requested length starts from an earlier prompt (a later turn of a recent conversation), from
the common system prompt, or from nothing; what the base lacks is drawn fresh. A base longer than the prompt is cut
short: a shorter turn still shares its first pages.
"""

from __future__ import annotations

import random
from collections import deque

VOCAB = 32000
SYSTEM_PAGES = 3
RECENT = 8  # conversations a new turn may continue


class Conversations:
    def __init__(self, rng: random.Random, page_size: int):
        self.rng = rng
        self.system = tuple(rng.randrange(VOCAB) for _ in range(SYSTEM_PAGES * page_size))
        self.earlier: deque[tuple[int, ...]] = deque(maxlen=RECENT)  # only the recent ones: memory stays flat

    def prompt(self, length: int) -> tuple[int, ...]:
        draw = self.rng.random()
        if self.earlier and draw < 0.5:
            base = self.rng.choice(self.earlier)
        elif draw < 0.8:
            base = self.system
        else:
            base = ()
        base = base[:length]
        tokens = base + self._fresh(length - len(base))
        self.earlier.append(tokens)
        return tokens

    def _fresh(self, count: int) -> tuple[int, ...]:
        """``count`` tokens, each ``rng.randrange(VOCAB)`` (the same draws: ``test_sim`` holds the two together),
        without its two calls per token: drawing the tokens was a sixth of a long run."""
        getrandbits, bits, out = self.rng.getrandbits, VOCAB.bit_length(), []
        for _ in range(count):
            token = getrandbits(bits)
            while token >= VOCAB:
                token = getrandbits(bits)
            out.append(token)
        return tuple(out)
