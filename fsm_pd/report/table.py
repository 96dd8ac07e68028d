"""Terminal and JSON views of a replay, written room by room as the replay streams (bounded memory)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import TextIO

from rich.console import Console
from rich.table import Table
from rich.text import Text

from fsm_pd.store.causes import NODE_DOWN, PEER_DOWN, PREFILL_COMPUTE
from fsm_pd.store.replay import ReplayResult, RoomReport, Summary

STATE_ABBREV = {"Bootstrapping": "boot", "WaitingForInput": "wait", "Transferring": "xfer",
                PREFILL_COMPUTE: "P-compute", NODE_DOWN: "down", PEER_DOWN: "peer-down"}
FINAL_STYLE = {"Success": "green", "Failed": "bold red"}
# One plain line per side, in columns of fixed width (the reason last, unbounded): rooms stream in and are printed
# as they come, and a rich Table costs ~7 ms a room to lay out, a minute for a million-row journal's failures.
LINE = "{room:>20}  {side:<8} {final:<8} {ended:<11} {spent:<36} {total:>8}  {pages:<16} {replay:<8} {reason}"


PAGES_LEGEND = ("pages moved: sent/prompt pages (prefill: pages it sent of the prompt's; decode: pages it received "
                "of those it reserved); cN: prompt tokens the prefill node's prefix cache held; hN: leading pages the "
                "decode node's prefix cache held, which were not sent")


def pages_moved(report: RoomReport) -> str:
    """``moved/prompt pages`` and the caches' part: ``c`` tokens a prefill took from its cache, ``h`` leading pages
    the decode node held."""
    p = report.pages
    if not p:
        return "-"
    if report.role == "prefill":
        return f"{p['sent']}/{p['pages']} c{p['cached_tokens']} h{p['decode_cached_pages']}"
    return f"{p.get('received', '?')}/{p['pages']} c{p.get('prefill_cached_tokens', 0)} h{p['cached_pages']}"


def _seconds(value: float) -> str:
    return f"{value * 1000:.1f}ms" if value < 1 else f"{value:.2f}s"


def spent(report: RoomReport) -> str:
    """Time in each state, with a chunked prompt's compute, a dead node's and a dead peer's time apart
    (``RoomReport.phases``, ``store/causes.py``): ``xfer`` is then the handoff's own time."""
    times = report.phases if report.phases is not None else report.time_in_state
    return "  ".join(f"{STATE_ABBREV.get(s, s)} {_seconds(t)}" for s, t in times.items()) or "-"  # a record: none


class TableWriter:
    """The replay as text, one line per side as rooms stream in; a single room also gets its timeline."""

    def __init__(self, console: Console, files: Sequence[str]):
        self.console = console
        self.files = list(files)
        self.shown = 0
        self.last: list[RoomReport] | None = None
        self.color = console.is_terminal
        console.print(f"fsm-pd replay of {', '.join(self.files)}", style="bold", highlight=False)
        self._write(LINE.format(room="room", side="side", final="final", ended="ended by", spent="time in states",
                                total="total", pages="pages moved", replay="replay", reason="reason"))

    def _write(self, line: str) -> None:
        self.console.file.write(line + "\n")

    def room(self, sides: list[RoomReport]) -> None:
        for r in sides:
            line = LINE.format(room=r.room, side=r.role, final=r.final, ended=r.ended_by or "-", spent=spent(r),
                               total=_seconds(r.ended_at - r.started_at), pages=pages_moved(r),
                               replay="ok" if r.consistent else "DIVERGED", reason=r.why or "-")
            if self.color:  # a terminal: the final state in colour, through rich (a human is reading, not a pipe)
                self.console.print(Text(line, style=FINAL_STYLE.get(r.final, "yellow")), highlight=False,
                                   soft_wrap=True)
            else:
                self._write(line)
        self.shown += 1
        self.last = sides

    def close(self, summary: Summary) -> None:
        if self.shown == 1 and self.last is not None:
            print_timeline(self.last, self.console)
        if self.shown:
            self.console.print(PAGES_LEGEND, highlight=False, soft_wrap=True)
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
