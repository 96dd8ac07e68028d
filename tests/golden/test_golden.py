"""Committed journals replay consistently through today's tables; a tampered one is caught and named."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fsm_pd.cli.main import EXIT_DIVERGED, EXIT_OK, main
from fsm_pd.store import write_rows

HERE = Path(__file__).resolve().parent
COLUMNS = ("node", "role", "room", "version", "trigger", "src", "dst", "payload", "at")


def load(name: str, tmp_path: Path) -> Path:
    """Turn a golden .jsonl into a real SQLite journal, as a node would have written it."""
    rows = [json.loads(line) for line in (HERE / f"{name}.jsonl").read_text().splitlines()]
    path = tmp_path / f"{name}.db"
    write_rows(path, ([r[c] for c in COLUMNS] for r in rows))
    return path


EXPECTED = {
    "success": {"prefill": ("Success", None), "decode": ("Success", None)},
    "timeout": {"prefill": ("Failed", "bootstrap timeout"), "decode": ("Failed", "waiting timeout")},
    "prefill_crash": {"prefill": ("Failed", "local error: node restarted"),
                      "decode": ("Failed", "peer failed: prefill-0 missed 2 heartbeats")},
    "abort": {"prefill": ("Failed", "aborted by peer: client went away"), "decode": ("Failed", "client went away")},
}


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_golden_journal_replays_consistently(name, tmp_path, capsys):
    journal = load(name, tmp_path)
    assert main(["replay", str(journal), "--format", "json"]) == EXIT_OK
    doc = json.loads(capsys.readouterr().out)
    assert doc["consistent"] is True
    got = {r["role"]: (r["final"], r["reason"]) for r in doc["rooms"]}
    assert got == EXPECTED[name]


def test_tampered_journal_is_a_divergence_naming_the_room(tmp_path, capsys):
    journal = load("tampered", tmp_path)
    assert main(["replay", str(journal)]) == EXIT_DIVERGED
    err = capsys.readouterr().err
    assert "room 1 decode" in err and "expected dst 'Success', journal has 'Failed'" in err
