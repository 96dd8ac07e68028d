"""The suite's own settings do what pyproject.toml and tests/conftest.py say: a test that runs past its timeout
fails (and the run goes on). Checked on a throwaway suite run by a fresh pytest with this project's pyproject.toml
and conftest.py."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

THROWAWAY = '''
import time
import pytest

def test_quick():
    pass

@pytest.mark.timeout(1)
def test_hangs():
    time.sleep(60)
'''


def run_suite(tmp_path: Path, *args: str) -> str:
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    (tmp_path / "tests").mkdir(exist_ok=True)
    shutil.copy(ROOT / "tests" / "conftest.py", tmp_path / "tests" / "conftest.py")
    (tmp_path / "tests" / "test_throwaway.py").write_text(THROWAWAY)
    # only the plugin under test: the others this environment installs (schemathesis, hypothesis) load slowly
    env = os.environ | {"PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"}
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "pytest_timeout", "-p", "no:cacheprovider",
                           *args], cwd=tmp_path,
                          env=env, capture_output=True, text=True, timeout=120)
    return done.stdout + done.stderr


def test_a_test_past_its_timeout_fails_and_the_run_goes_on(tmp_path):
    out = run_suite(tmp_path)
    assert "Timeout" in out and "FAILED tests/test_throwaway.py::test_hangs" in out
    assert "1 failed, 1 passed" in out
