"""One client request's attempts: every room created for its request id, on any node, in the order they began.

A router that retries or migrates a request opens a new bootstrap room per attempt and sends the client's request id
as ``rid`` each time; each node journals it in the room's first row (and in its ``rooms`` row, the index
``replay --request`` reads). An attempt is one room: its prefill side and its decode side, from whichever journals
hold them, and the records its nodes wrote for it (``roles.py``): a ``local`` prefill, a decode node's ``recompute``
of a failed transfer (then the request was answered after all), a ``peer`` found dead after the room ended.

The id a client sees is the rid itself on ``/generate`` (``meta_info.id``) and in an error's body (``error.rid``),
and the rid behind a prefix on the OpenAI APIs (``chatcmpl-RID``, ``cmpl-RID``): ``journal_rids`` gives the rids
any of them may be journaled under.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from fsm_pd.store.causes import explain_retries
from fsm_pd.store.replay import RoomReport, by_room
from fsm_pd.store.roles import PEER_ROLE, RECOMPUTE_ROLE

AFTERWARDS = frozenset({RECOMPUTE_ROLE, PEER_ROLE})  # records of what a node did for the room once it had ended

# What the OpenAI APIs put before the rid in their answers' ``id`` (``fsm_pd/api/openai_routes.py``)
OPENAI_ID_PREFIXES = ("chatcmpl-", "cmpl-")


def journal_rids(client_id: str) -> list[str]:
    """The rids the id a client saw may be journaled under, the likeliest first: the id itself (a client's own rid
    may well start like an OpenAI id), then the id without the prefix an OpenAI answer put before the rid."""
    found = [client_id]
    for prefix in OPENAI_ID_PREFIXES:
        if client_id.startswith(prefix) and len(client_id) > len(prefix):
            found.append(client_id[len(prefix):])
    return found


@dataclass(slots=True)
class Attempt:
    room: int
    sides: list[RoomReport]  # ordered by role: decode, local, peer, prefill, recompute

    @property
    def handoff(self) -> list[RoomReport]:
        """The sides of the attempt itself (prefill, decode; or a ``local`` record), without what a node recorded for
        the room after it ended."""
        return [s for s in self.sides if s.role not in AFTERWARDS] or self.sides

    @property
    def recompute(self) -> RoomReport | None:
        """The decode node's recompute of this attempt's failed transfer, if it ran."""
        return next((s for s in self.sides if s.role == RECOMPUTE_ROLE), None)

    @property
    def started_at(self) -> float:
        return min(s.started_at for s in self.handoff)

    @property
    def ended_at(self) -> float:
        return max(s.ended_at for s in self.handoff)

    @property
    def outcome(self) -> str:
        """Success when every side succeeded, Failed when one failed or died, open while a side has not ended;
        Recomputed when the transfer failed and the decode node answered the request by prefilling it itself."""
        if self.recompute is not None and self.recompute.final == "Success":
            return "Recomputed"
        finals = {s.final for s in self.handoff}
        if "Failed" in finals or any(s.alive_until is not None for s in self.handoff):
            return "Failed"
        return "Success" if finals == {"Success"} else "open"

    @property
    def failed_first(self) -> RoomReport | None:
        """The side that failed first: the one whose failure the other side's was a consequence of, if any. A side
        whose node died failed when it was last alive (``alive_until``), whenever its restart said so; a side the
        router closed because of the other (``consequence``) comes after it."""
        failed = [s for s in self.handoff if s.failed or s.alive_until is not None]
        if not failed:
            return None
        return min(failed, key=lambda s: (s.consequence, s.alive_until if s.alive_until is not None else s.ended_at))

    @property
    def route(self) -> str | None:
        """The path the router chose for this attempt and why (``router/policy.py``), when it said: ``local`` (the
        decode node prefilled it, a ``local`` record) or ``pd`` (a decode room's create event)."""
        for side in self.sides:
            for event in side.events:
                if event.get("route"):
                    path = "local" if side.role == "local" else "pd"
                    return f"{path} ({event['route']})"
        return None

    @property
    def where(self) -> str:
        return ", ".join(f"{s.role} {s.node}" for s in self.handoff)


def attempts(reports: Iterable[RoomReport]) -> list[Attempt]:
    """Group room-ordered reports into attempts, in the order they began; a side the router closed to retry the
    request says so (``causes.explain_retries``)."""
    found = sorted((Attempt(sides[0].room, sides) for sides in by_room(reports)), key=lambda a: (a.started_at, a.room))
    explain_retries(found)
    return found
