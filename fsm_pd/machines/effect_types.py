"""Effect *descriptions*: what a transition asks the outside world to do. Nothing here does it.

A transition lists its effects in the table; the runtime journals the transition and only then hands the effects to
the interpreter (``fsm_pd.effects``). Effects carry no per-request data: the handler reads what it needs (peer
address, page ids, uuid) from the room's recorded context, so the effect list of a transition is a pure function of
the table row and replay can compare it exactly.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields


@dataclass(frozen=True, slots=True)
class Effect:
    def to_dict(self) -> dict:
        return {"type": type(self).__name__, **{f.name: getattr(self, f.name) for f in fields(self)}}


@dataclass(frozen=True, slots=True)
class ArmTimer(Effect):
    """Start the room's deadline ``timer``; its length comes from the room's recorded deadlines."""

    timer: str


@dataclass(frozen=True, slots=True)
class CancelTimer(Effect):
    timer: str


@dataclass(frozen=True, slots=True)
class Send(Effect):
    """Send side-channel message ``kind`` (PREPARE, READY, PULLED, ABORT) to the room's peer."""

    kind: str


@dataclass(frozen=True, slots=True)
class GatherAndPublish(Effect):
    """P: copy the request's pages into a staging buffer and publish it for the decode node to pull."""


@dataclass(frozen=True, slots=True)
class ReleaseStaging(Effect):
    """P: drop the staging buffer and its published entry (late pullers then fail fast)."""


@dataclass(frozen=True, slots=True)
class ResolveBootstrap(Effect):
    """D: ask the bootstrap server where the prefill node's side channel and transfer server are."""


@dataclass(frozen=True, slots=True)
class ReservePages(Effect):
    """D: reserve KV pages for the prompt (admission control; may wait for free pages)."""


@dataclass(frozen=True, slots=True)
class Pull(Effect):
    """D: pull the published staging buffer on a worker thread and verify it (ready, error-free, layout)."""


@dataclass(frozen=True, slots=True)
class Scatter(Effect):
    """D: write the verified staging buffer into the reserved pages (on the model thread)."""


@dataclass(frozen=True, slots=True)
class FreePages(Effect):
    """D: return the room's reserved pages to the pool once nothing can write to them any more."""


def effects_json(effects: tuple[Effect, ...]) -> str:
    """The journal's encoding of an effect list; also what replay compares."""
    return json.dumps([e.to_dict() for e in effects], separators=(",", ":"))
