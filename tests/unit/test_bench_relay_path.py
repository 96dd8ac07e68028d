"""bench/relay_path.py on this machine: both paths it times (the router's relay, and the pass-through of an
in-process decode stream) deliver every event of every stream, and it prints a figure for each and their ratio."""

from __future__ import annotations

import asyncio
import contextlib
import sys
import tempfile
from argparse import Namespace
from pathlib import Path
from unittest import mock

sys.path.append(str(Path(__file__).resolve().parents[2] / "bench"))
import relay_path  # noqa: E402

import fsm_pd.router.core as core  # noqa: E402


def test_both_paths_deliver_every_event_of_every_stream():
    async def scene():
        with tempfile.TemporaryDirectory() as tmp:
            app = relay_path.router(tmp, relay_path.engine(40))
            counts = {}
            for path in ("relay", "passthrough"):
                hidden = mock.patch.object(core, "PASS_TO", "hidden") if path == "relay" else contextlib.nullcontext()
                with hidden:
                    counts[path] = await asyncio.gather(*(relay_path.one_stream(app) for _ in range(3)))
            return counts

    assert asyncio.run(scene()) == {"relay": [40, 40, 40], "passthrough": [40, 40, 40]}


def test_a_quick_run_prints_each_path_and_their_ratio(capsys):
    asyncio.run(relay_path.main(Namespace(chunks=30, streams=2, rounds=1)))
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert [line.split()[0] for line in lines[:4]] == ["relay", "passthrough"] * 2
    assert all("us CPU a chunk (2 streams of 30 chunks)" in line for line in lines[:4])
    assert lines[4].startswith("passthrough / relay: ") and lines[4].endswith(" us less)")


def test_a_process_clock_that_ticks_coarsely_still_gives_a_figure_for_each_path(capsys, monkeypatch):
    """On the TPU host a quick run's round took less than the process clock's tick: it read 0 s, and the ratio
    divided by it. A clock of 10 ms ticks stands in for that one here."""
    fine = relay_path.time.process_time
    monkeypatch.setattr(relay_path.time, "process_time", lambda: int(fine() * 100) / 100)
    asyncio.run(relay_path.main(Namespace(chunks=30, streams=2, rounds=1)))
    figures = [float(line.split()[1]) for line in capsys.readouterr().out.splitlines()[:4]]
    assert all(us > 0 for us in figures)
