"""Terminal and JSON views of a replay, written room by room as the replay streams (bounded memory)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import TextIO

from rich.console import Console
from rich.table import Table
from rich.text import Text

from fsm_pd.store.replay import ReplayResult, RoomReport, Summary

STATE_ABBREV = {"Bootstrapping": "boot", "WaitingForInput": "wait", "Transferring": "xfer"}
FINAL_STYLE = {"Success": "green", "Failed": "bold red"}
# fixed widths (cells, padding included): the table is printed in chunks as rooms stream in, and every chunk must
# line up; together they fit 160 columns, room ids up to 2**63 included
COLUMNS = (("room", 21), ("side", 9), ("final", 9), ("ended by", 12), ("reason", 46), ("time in states", 34),
           ("total", 9), ("replay", 10))
CHUNK = 200  # rooms per printed chunk


def _seconds(value: float) -> str:
    return f"{value * 1000:.1f}ms" if value < 1 else f"{value:.2f}s"


def spent(report: RoomReport) -> str:
    return "  ".join(f"{STATE_ABBREV.get(s, s)} {_seconds(t)}" for s, t in report.time_in_state.items())


class TableWriter:
    """The replay as a terminal table, printed every ``CHUNK`` rooms; a single room also gets its timeline."""

    def __init__(self, console: Console, files: Sequence[str]):
        self.console = console
        self.files = list(files)
        self.table: Table | None = None
        self.in_table = 0
        self.printed = 0
        self.last: list[RoomReport] | None = None

    def _new_table(self) -> Table:
        first = self.printed == 0
        table = Table(title=f"fsm-pd replay of {', '.join(self.files)}" if first else None, show_header=first)
        for name, width in COLUMNS:
            table.add_column(name, overflow="fold", width=width)
        return table

    def room(self, sides: list[RoomReport]) -> None:
        if self.table is None:
            self.table = self._new_table()
        for r in sides:
            self.table.add_row(
                str(r.room), r.role, Text(r.final, style=FINAL_STYLE.get(r.final, "yellow")), r.ended_by or "-",
                r.reason or "-", spent(r), _seconds(r.ended_at - r.started_at),
                Text("ok", style="green") if r.consistent else Text("DIVERGED", style="bold red"),
            )
        self.in_table += 1
        self.last = sides
        if self.in_table >= CHUNK:
            self._print()

    def _print(self) -> None:
        if self.table is not None:
            self.console.print(self.table)
            self.printed += self.in_table
        self.table, self.in_table = None, 0

    def close(self, summary: Summary) -> None:
        shown = self.printed + self.in_table
        self._print()
        if shown == 1 and self.last is not None:
            print_timeline(self.last, self.console)
        for d in summary.divergences:
            self.console.print(Text(f"divergence: {d.describe()}", style="bold red"))
        verdict = "every room replays consistently" if summary.consistent else f"{len(summary.divergences)} diverged"
        self.console.print(f"{summary.rooms} rooms, {summary.failed} with a failed side; {verdict}.")


def print_timeline(rooms: Sequence[RoomReport], console: Console, title: str | None = None) -> None:
    """Sides merged in time order (both sides of one room, or every attempt of one request)."""
    events = sorted(((e["at"], r.role, r.node, r.room, e) for r in rooms for e in r.events),
                    key=lambda x: (x[0], x[1]))
    start = events[0][0]
    many_rooms = len({r.room for r in rooms}) > 1
    timeline = Table(title=title or f"room {rooms[0].room}: both sides in time order")
    for name in ("t", *(("node", "room") if many_rooms else ()), "side", "trigger", "transition", "detail"):
        timeline.add_column(name)
    for at, role, node, room, e in events:
        move = f"{e['src']} -> {e['dst']}" if e["src"] != e["dst"] else e["src"]
        detail = e.get("ignored") and f"ignored: {e['ignored']}" or e.get("detail") or ""
        where = (node, str(room)) if many_rooms else ()
        timeline.add_row(f"+{_seconds(at - start)}", *where, role, e["trigger"], move, str(detail))
    console.print(timeline)


class JsonWriter:
    """``{"journals": [...], "rooms": [...], "consistent": ..., "divergences": [...]}``, one room per line."""

    def __init__(self, out: TextIO, files: Sequence[str]):
        self.out = out
        self.first = True
        out.write('{"journals": ' + json.dumps(list(files)) + ',\n "rooms": [')

    def room(self, sides: list[RoomReport]) -> None:
        for r in sides:
            self.out.write(("\n  " if self.first else ",\n  ") + json.dumps(r.to_dict(), sort_keys=True))
            self.first = False

    def close(self, summary: Summary) -> None:
        self.out.write('\n ],\n "consistent": ' + json.dumps(summary.consistent) + ',\n "divergences": '
                       + json.dumps([d.describe() for d in summary.divergences]) + "\n}\n")


def to_json(result: ReplayResult, rooms: Sequence[RoomReport], journals: Sequence[str]) -> str:
    """An in-memory replay as one JSON document (the same fields as ``JsonWriter``)."""
    doc = {
        "journals": list(journals),
        "consistent": result.consistent,
        "divergences": [d.describe() for d in result.divergences],
        "rooms": [r.to_dict() for r in rooms],
    }
    return json.dumps(doc, indent=1, sort_keys=True)
