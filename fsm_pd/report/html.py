"""A self-contained HTML swimlane timeline: one block per room, one lane per side, states as coloured spans.

No scripts, fonts or stylesheets are fetched: the file opens offline and can be attached to a bug report.
"""

from __future__ import annotations

from collections.abc import Sequence
from html import escape
from typing import TextIO

from fsm_pd.store.replay import RoomReport, Summary

COLORS = {"Bootstrapping": "#9ecae1", "WaitingForInput": "#fdd49e", "Transferring": "#c7e9c0",
          "Success": "#31a354", "Failed": "#de2d26"}

STYLE = """
body{font:13px system-ui,sans-serif;margin:24px;color:#222}
h1{font-size:18px} .room{margin:14px 0;border-top:1px solid #ddd;padding-top:8px}
.head{font-weight:600;margin-bottom:4px} .bad{color:#de2d26} .ok{color:#31a354}
.lane{display:flex;align-items:center;margin:2px 0} .label{width:70px;flex:none;color:#555}
.track{position:relative;height:22px;flex:1;background:#f4f4f4;border-radius:3px}
.seg{position:absolute;top:0;height:22px;border-radius:2px;overflow:hidden;font-size:11px;line-height:22px;
 padding-left:3px;box-sizing:border-box;white-space:nowrap}
.tick{position:absolute;top:-3px;width:2px;height:28px;background:#333}
.tick.ignored{background:#aaa} .legend span{display:inline-block;padding:2px 8px;margin-right:6px;border-radius:3px}
.why{margin-left:70px;color:#555}
"""


class HtmlWriter:
    """The page, written room by room as the replay streams; the verdict comes last, once every room is read."""

    def __init__(self, out: TextIO, files: Sequence[str]):
        self.out = out
        self.shown = 0
        legend = "".join(f'<span style="background:{c}">{escape(s)}</span>' for s, c in COLORS.items())
        out.write("<!DOCTYPE html><html><head><meta charset='utf-8'><title>fsm-pd replay</title>"
                  f"<style>{STYLE}</style></head><body>"
                  f"<h1>fsm-pd replay: {escape(', '.join(files))}</h1><p class='legend'>{legend}</p>")

    def room(self, sides: list[RoomReport]) -> None:
        self.out.write(_room_block(sides[0].room, sides))
        self.shown += 1

    def close(self, summary: Summary) -> None:
        verdict = ("every room replays consistently" if summary.consistent
                   else f'<span class="bad">{len(summary.divergences)} rooms diverge from the tables</span>')
        self.out.write(f"<p>{self.shown} rooms shown of {summary.rooms}; {verdict}.</p></body></html>")


def _room_block(room: int, sides: list[RoomReport]) -> str:
    start = min(s.started_at for s in sides)
    span = max(max(s.ended_at for s in sides) - start, 1e-9)
    head_bits = []
    for s in sorted(sides, key=lambda s: s.role):
        cls = "ok" if s.final == "Success" else "bad"
        head_bits.append(f'{escape(s.role)}: <span class="{cls}">{escape(s.final)}</span>')
        if not s.consistent:
            head_bits.append(f'<span class="bad">DIVERGED: {escape(s.divergence.describe())}</span>')
    lanes, whys = [], []
    for s in sorted(sides, key=lambda s: s.role):
        lanes.append(_lane(s, start, span))
        if s.reason:
            whys.append(f'<div class="why">{escape(s.role)} failed on <b>{escape(s.ended_by or "?")}</b>: '
                        f"{escape(s.why)}</div>")
        elif s.cause:  # a side whose journal stops: its node died
            whys.append(f'<div class="why">{escape(s.role)}: {escape(s.cause)}</div>')
    return (f'<div class="room"><div class="head">room {room} &middot; {" &middot; ".join(head_bits)} '
            f"&middot; {span * 1000:.1f} ms</div>{''.join(lanes)}{''.join(whys)}</div>")


def _lane(side: RoomReport, start: float, span: float) -> str:
    segs, ticks = [], []
    state, entered = side.events[0]["src"], side.events[0]["at"]
    for e in side.events:
        left = 100 * (e["at"] - start) / span
        tip = f"{e['trigger']}: {e['src']} -> {e['dst']} at +{(e['at'] - start) * 1000:.2f} ms"
        if "ignored" in e:
            tip += f" (ignored: {e['ignored']})"
        elif "detail" in e:
            tip += f" ({e['detail']})"
        ticks.append(f'<div class="tick{" ignored" if "ignored" in e else ""}" style="left:{left:.3f}%" '
                     f'title="{escape(tip)}"></div>')
        if e["dst"] != state:
            segs.append(_segment(state, entered, e["at"], start, span))
            state, entered = e["dst"], e["at"]
    # a terminal state is drawn as a short cap; a room left unfinished runs to the end of the block
    end = entered if state in ("Success", "Failed") else start + span
    segs.append(_segment(state, entered, end, start, span, min_width=1.5))
    return (f'<div class="lane"><div class="label">{escape(side.role)}</div>'
            f'<div class="track">{"".join(segs)}{"".join(ticks)}</div></div>')


def _segment(state: str, t0: float, t1: float, start: float, span: float, min_width: float = 0.3) -> str:
    left = 100 * (t0 - start) / span
    width = max(100 * (t1 - t0) / span, min_width)
    return (f'<div class="seg" style="left:{left:.3f}%;width:{width:.3f}%;background:{COLORS.get(state, "#ccc")}" '
            f'title="{escape(state)} for {(t1 - t0) * 1000:.2f} ms">{escape(state)}</div>')
