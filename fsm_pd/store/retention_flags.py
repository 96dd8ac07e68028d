"""The serve flags of journal retention (``retention.py``), without SQLAlchemy: a node's parser is built before the
device opens, and importing the database layer there put 0.4-0.8 s in front of the chip's opening (``--role pd``'s
warm start began its open 0.8 s after a colocated node's, round r13)."""

from __future__ import annotations

import argparse
import re

DEFAULT_KEEP = "7d"
DEFAULT_MAX_ROWS = 2_000_000  # about 600 MB of SQLite at ~290 bytes a row
_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}


def parse_duration(text: str) -> float | None:
    """'7d', '12h', '30m', '90s' or plain seconds; '0' or 'off' disables (None)."""
    text = text.strip().lower()
    if text in ("0", "off", "none"):
        return None
    match = re.fullmatch(r"(\d+(?:\.\d+)?)([smhd]?)", text)
    if not match:
        raise argparse.ArgumentTypeError(f"expected a duration like 7d, 12h, 30m or 3600, got {text!r}")
    return float(match.group(1)) * _UNITS[match.group(2) or "s"]


def add_retention_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--journal-keep", type=parse_duration, default=parse_duration(DEFAULT_KEEP), metavar="AGE",
                        help="finished rooms older than AGE leave the live journal for monthly archive files "
                             "(NAME.archive-YYYY-MM.db) that fsm-pd replay reads with it; open rooms always stay. "
                             f"7d, 12h, 30m or seconds; 0 turns age-based archiving off (default {DEFAULT_KEEP})")
    parser.add_argument("--journal-max-rows", type=int, default=DEFAULT_MAX_ROWS, metavar="N",
                        help="above N rows in the live journal the oldest finished rooms are archived whatever "
                             f"their age; 0 for no cap (default {DEFAULT_MAX_ROWS:,}, about 600 MB)")
    parser.add_argument("--journal-archive-dir", default=None, metavar="DIR",
                        help="where archives go (default: beside the journal file; a journal URL without it is "
                             "not archived)")
