"""SGLang's ``KVPoll`` states, with the same integers: the numeric order is part of the protocol.

SGLang reduces per-rank polls with ``min``, so Failed (0) must sort lowest and Success (4) highest.
"""

from __future__ import annotations

from enum import IntEnum


class KVPoll(IntEnum):
    Failed = 0
    Bootstrapping = 1
    WaitingForInput = 2
    Transferring = 3
    Success = 4


INITIAL = KVPoll.Bootstrapping.name
TERMINAL = frozenset({KVPoll.Success.name, KVPoll.Failed.name})
STATE_NAMES = tuple(s.name for s in KVPoll)
