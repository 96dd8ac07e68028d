"""Prompts that share prefixes, as a chat service's do: so the prefix caches hit, evict and lock.

Each prompt of the requested length starts from an earlier prompt (a later turn of a recent conversation), from
the common system prompt, or from nothing; what the base lacks is drawn fresh. A base longer than the prompt is cut
short: a shorter turn still shares its first pages.
"""

from __future__ import annotations

import random

VOCAB = 32000
SYSTEM_PAGES = 3
RECENT = 8  # conversations a new turn may continue


class Conversations:
    def __init__(self, rng: random.Random, page_size: int):
        self.rng = rng
        self.system = tuple(rng.randrange(VOCAB) for _ in range(SYSTEM_PAGES * page_size))
        self.earlier: list[tuple[int, ...]] = []

    def prompt(self, length: int) -> tuple[int, ...]:
        draw = self.rng.random()
        if self.earlier and draw < 0.5:
            base = self.rng.choice(self.earlier[-RECENT:])
        elif draw < 0.8:
            base = self.system
        else:
            base = ()
        base = base[:length]
        tokens = base + tuple(self.rng.randrange(VOCAB) for _ in range(length - len(base)))
        self.earlier.append(tokens)
        return tokens
