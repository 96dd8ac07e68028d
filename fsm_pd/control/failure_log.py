"""One structured log line per failed room: what failed, where, why, and the command that explains it.

The line's message is one JSON object (``"event": "failed_room"``), so a log shipper can parse it without a
grammar: everything from the first ``{`` of the line is JSON. ``replay`` is the exact command to run next to the
journal (a copy of it on another machine works too: the file name is what counts).
"""

from __future__ import annotations

import json
import logging
import shlex
from urllib.parse import unquote

from fsm_pd.machines.guards import layout_differences

log = logging.getLogger("fsm_pd.failed_room")

SQLITE_PREFIX = "sqlite:///"


def journal_argument(url: str | None) -> str | None:
    """What ``fsm-pd replay`` takes for this journal: the file of a SQLite URL, any other URL as it is."""
    if url is None:
        return None
    if url.startswith(SQLITE_PREFIX):
        return unquote(url[len(SQLITE_PREFIX):].split("?", 1)[0])
    return url


def failed_room_record(node, room, decision, reason_class: str) -> dict:
    """The fields of the line for ``room``, which ``decision`` just failed on ``node``."""
    journal = journal_argument(getattr(getattr(node, "journal", None), "url", None))
    replay = None
    if journal is not None:
        replay = f"fsm-pd replay --room {room.room} {shlex.quote(journal)}"
    record = {
        "event": "failed_room",
        "room": room.room,
        "rid": room.ctx.get("rid"),
        "node": node.node_id,
        "role": node.role,
        "state": decision.src,  # the state it failed in
        "trigger": decision.trigger,
        "reason_class": reason_class,
        "reason": decision.reason,
        "replay": replay,
    }
    ours, theirs = room.ctx.get("layout"), room.ctx.get("peer_layout")
    if reason_class == "layout_mismatch" and isinstance(ours, dict) and isinstance(theirs, dict):
        record["layout_differs"] = layout_differences(ours, theirs)  # what to fix: "page_size", say
    return record


def log_failed_room(node, room, decision, reason_class: str) -> None:
    log.warning("%s", json.dumps(failed_room_record(node, room, decision, reason_class), separators=(",", ":")))
