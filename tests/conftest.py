"""Suite-wide test settings: what the ``slow`` marker means.

``@pytest.mark.slow`` is for tests too long for every run (soaks, long drills, long hypothesis profiles): they are
deselected unless ``FSM_PD_SLOW=1`` is set or ``-m`` names the marker (``-m slow`` runs only them). CI's default run
(``bash .ci/run``) leaves them out, so the whole suite stays within its time budget. Every test also has a timeout
(pytest-timeout, 300 s by default in pyproject.toml; a longer test sets its own with ``@pytest.mark.timeout(S)``).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

# Helpers every test tree shares (the model-free stub engine, the in-process "fake" transfer backend) live beside this
# file, outside the package.
sys.path.insert(0, str(Path(__file__).resolve().parent))

from fsm_pd.transport.backends import register_backend  # noqa: E402 - after the path above

register_backend("fake", "fake_backend:FakeTransferBackend", replace=True)

SLOW_ENV = "FSM_PD_SLOW"
# Every node a test starts (fsm-pd serve / launch without --model) serves the built-in tiny model, not SmolLM2.
os.environ["FSM_PD_MODEL"] = "tiny"
# ... and starts serving without its warm-up (seconds per node start; a test sends a few shapes). The warm-up's own
# tests turn it back on (tests/unit/test_warmup.py, tests/integration/test_warmup_serving.py).
os.environ["FSM_PD_SKIP_SERVER_WARMUP"] = "1"


def pytest_collection_modifyitems(config, items):
    if os.environ.get(SLOW_ENV) == "1" or "slow" in (config.getoption("markexpr") or ""):
        return
    slow = [item for item in items if item.get_closest_marker("slow") is not None]
    if slow:
        config.hook.pytest_deselected(items=slow)
        items[:] = [item for item in items if item.get_closest_marker("slow") is None]
