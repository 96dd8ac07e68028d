"""``replay --request RID``: every attempt of one request on one timeline, as a terminal report or JSON."""

from __future__ import annotations

import json
from collections.abc import Sequence

from rich.console import Console
from rich.table import Table
from rich.text import Text

from fsm_pd.report.table import FINAL_STYLE, _seconds, print_timeline, spent
from fsm_pd.store.request import Attempt


def story(chain: Sequence[Attempt]) -> list[str]:
    """One sentence per attempt: where it ran, how it ended and why, and what came next."""
    lines = []
    for i, a in enumerate(chain, 1):
        took = _seconds(a.ended_at - a.started_at)
        if a.outcome == "Success":
            line = f"attempt {i} (room {a.room} on {a.where}) succeeded after {took}"
        elif a.outcome in ("Failed", "Recomputed") and a.failed_first is not None:
            first = a.failed_first
            how = "died" if first.alive_until is not None else f"ended it on {first.ended_by}"
            failed = "failed its transfer" if a.outcome == "Recomputed" else "failed"
            line = (f"attempt {i} (room {a.room} on {a.where}) {failed} after {took}: {first.role} {first.node} {how}: "
                    f"{first.why}")
        else:
            line = f"attempt {i} (room {a.room} on {a.where}) has not ended in these journals"
        if a.recompute is not None:
            line += f"; {_recomputed(a)}"
        if a.route is not None:
            line += f"; routed {a.route}"
        if i < len(chain):
            following = chain[i]
            gap = following.started_at - a.ended_at
            when = f"{_seconds(gap)} after it ended" if gap >= 0 else f"{_seconds(-gap)} before it ended"
            line += f"; next: attempt {i + 1} began {when}, room {following.room} on {following.where}"
        else:
            line += "; no later attempt in these journals"
        lines.append(line)
    return lines


def _recomputed(a: Attempt) -> str:
    """What the decode node's recompute of a failed transfer did for the request (``store/roles.py``)."""
    r = a.recompute
    if r.final != "Success":
        return f"the recompute on decode {r.node} failed too: {r.reason}"
    return f"answered by decode {r.node} after recompute ({r.events[0].get('detail')})"


def render_request(rid: str, chain: Sequence[Attempt], files: Sequence[str], console: Console) -> None:
    start = chain[0].started_at
    table = Table(title=f"request {rid}: {len(chain)} attempt(s), from {', '.join(files)}")
    for name in ("attempt", "room", "side", "node", "final", "ended by", "reason", "time in states", "began",
                 "total"):
        table.add_column(name, overflow="fold")
    for i, a in enumerate(chain, 1):
        for s in a.sides:
            table.add_row(str(i), str(a.room), s.role, s.node, Text(s.final, style=FINAL_STYLE.get(s.final, "yellow")),
                          s.ended_by or "-", s.why or "-", spent(s), f"+{_seconds(s.started_at - start)}",
                          _seconds(s.ended_at - s.started_at))
    console.print(table)
    print_timeline([s for a in chain for s in a.sides], console, title=f"request {rid}: every attempt in time order")
    for line in story(chain):
        console.print(line)


def request_json(rid: str, chain: Sequence[Attempt], files: Sequence[str]) -> str:
    doc = {"request": rid, "journals": list(files), "story": story(chain), "attempts": [
        {"attempt": i, "room": a.room, "outcome": a.outcome, "started_at": a.started_at, "ended_at": a.ended_at,
         "failed_first": None if a.failed_first is None else {
             "role": a.failed_first.role, "node": a.failed_first.node, "reason": a.failed_first.reason,
             "ended_by": a.failed_first.ended_by},
         "recompute": None if a.recompute is None else {
             "node": a.recompute.node, "final": a.recompute.final, "reason": a.recompute.reason,
             "at": a.recompute.ended_at},
         "next_room": chain[i].room if i < len(chain) else None,
         "sides": [s.to_dict() for s in a.sides]}
        for i, a in enumerate(chain, 1)]}
    return json.dumps(doc, indent=1, sort_keys=True)
