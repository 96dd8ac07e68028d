"""A node whose start-up fails ends at once (``exit_now``: ``os._exit``, whatever its threads are doing) and leaves
nothing behind: its ``--uds`` socket file, and under ``--role pd`` the private directory of its engines' sockets.

The start-up fails for real: ``FSM_PD_ATTENTION`` names no attention code, which the model's programs find only when
the start-up thread prepares them. That thread starts before the HTTP app is built (its programs load beside the
server's imports, ``serve.run_node``), so the failure can come before the server listens or after: either way
nothing is left.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

# the suite skips the start-up's programs (tests/conftest.py): here they are prepared, and fail
BROKEN = {"FSM_PD_ATTENTION": "bogus", "FSM_PD_SKIP_SERVER_WARMUP": "0", "FSM_PD_SIDE_CHANNEL_SECRET": "ab" * 32}


def failed_start(args: list[str], env: dict) -> str:
    """Run ``fsm-pd serve ARGS``; its output, once it exited 1 having said its start-up failed."""
    result = subprocess.run([sys.executable, "-m", "fsm_pd.cli", "serve", "--model", "tiny", "--compile-cache",
                             "off", *args], env={**os.environ, **BROKEN, **env}, capture_output=True, text=True,
                            timeout=120)
    out = result.stdout + result.stderr
    assert result.returncode == 1 and "start-up failed; exiting" in out and "FSM_PD_ATTENTION='bogus'" in out, out
    return out


@pytest.fixture
def short_dir():
    """A directory with a short path: unix socket paths must stay under 108 bytes."""
    path = Path(tempfile.mkdtemp(prefix="fsm-fail-", dir="/tmp"))
    yield path
    for child in sorted(path.rglob("*"), reverse=True):
        child.rmdir() if child.is_dir() else child.unlink()
    path.rmdir()


def test_a_failed_start_up_removes_the_nodes_socket(short_dir):
    sock = short_dir / "node.sock"
    out = failed_start(["--role", "colocated", "--uds", str(sock)], {})
    assert "start-up failed; exiting" in out
    assert sorted(p.name for p in short_dir.iterdir()) == []


def test_a_failed_start_up_of_role_pd_removes_its_socket_and_its_private_directory(short_dir):
    sock, scratch = short_dir / "pd.sock", short_dir / "tmp"
    scratch.mkdir()  # TMPDIR: where the process makes its private directory of the engines' sockets
    failed_start(["--role", "pd", "--uds", str(sock), "--journal-dir", str(short_dir / "journals")],
                 {"TMPDIR": str(scratch)})
    assert sorted(p.name for p in short_dir.iterdir()) == ["journals", "tmp"]
    assert list(scratch.iterdir()) == []
