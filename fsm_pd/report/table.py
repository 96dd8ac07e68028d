"""Terminal and JSON views of a replay."""

from __future__ import annotations

import json
from collections.abc import Sequence

from rich.console import Console
from rich.table import Table
from rich.text import Text

from fsm_pd.store.replay import ReplayResult, RoomReport

STATE_ABBREV = {"Bootstrapping": "boot", "WaitingForInput": "wait", "Transferring": "xfer"}
FINAL_STYLE = {"Success": "green", "Failed": "bold red"}


def _seconds(value: float) -> str:
    return f"{value * 1000:.1f}ms" if value < 1 else f"{value:.2f}s"


def render_table(result: ReplayResult, rooms: Sequence[RoomReport], journals: Sequence[str], console: Console) -> None:
    table = Table(title=f"fsm-pd replay of {', '.join(journals)}", show_lines=False)
    for name in ("room", "side", "final", "ended by", "reason", "time in states", "total", "replay"):
        table.add_column(name, overflow="fold")
    for r in rooms:
        spent = "  ".join(f"{STATE_ABBREV.get(s, s)} {_seconds(t)}" for s, t in r.time_in_state.items())
        table.add_row(
            str(r.room), r.role, Text(r.final, style=FINAL_STYLE.get(r.final, "yellow")), r.ended_by or "-",
            r.reason or "-", spent, _seconds(r.ended_at - r.started_at),
            Text("ok", style="green") if r.consistent else Text("DIVERGED", style="bold red"),
        )
    console.print(table)
    if len({r.room for r in rooms}) == 1:
        _print_timeline(rooms, console)
    for d in result.divergences:
        console.print(Text(f"divergence: {d.describe()}", style="bold red"))
    failed = len({r.room for r in result.rooms if r.failed})
    verdict = "every room replays consistently" if result.consistent else f"{len(result.divergences)} diverged"
    console.print(f"{len({r.room for r in result.rooms})} rooms, {failed} with a failed side; {verdict}.")


def _print_timeline(rooms: Sequence[RoomReport], console: Console) -> None:
    """Both sides of one room, merged in time order."""
    events = sorted(((e["at"], r.role, e) for r in rooms for e in r.events), key=lambda x: (x[0], x[1]))
    start = events[0][0]
    timeline = Table(title=f"room {rooms[0].room}: both sides in time order")
    for name in ("t", "side", "trigger", "transition", "detail"):
        timeline.add_column(name)
    for at, role, e in events:
        move = f"{e['src']} -> {e['dst']}" if e["src"] != e["dst"] else e["src"]
        detail = e.get("ignored") and f"ignored: {e['ignored']}" or e.get("detail") or ""
        timeline.add_row(f"+{_seconds(at - start)}", role, e["trigger"], move, str(detail))
    console.print(timeline)


def to_json(result: ReplayResult, rooms: Sequence[RoomReport], journals: Sequence[str]) -> str:
    doc = {
        "journals": list(journals),
        "consistent": result.consistent,
        "divergences": [d.describe() for d in result.divergences],
        "rooms": [r.to_dict() for r in rooms],
    }
    return json.dumps(doc, indent=1, sort_keys=True)
