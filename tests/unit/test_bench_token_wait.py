"""bench/token_wait.py on this machine: every token is read through the API's RequestRun, and a figure comes out."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.append(str(Path(__file__).resolve().parents[2] / "bench"))
import token_wait  # noqa: E402


def test_each_token_is_waited_for_and_read_once(capsys):
    assert token_wait.main(["--tokens", "300", "--runs", "2"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("next_output: ") and "us a token (median of 2 runs of 300" in out
