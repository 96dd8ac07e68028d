"""What a colocated node's start imports: the serving code, not what only other roles or other devices use.

Imports run on the node's main thread while jax opens the devices beside it; on the chip they took 5 to 9 s of a warm
start whose target is 10 s. A colocated node keeps no journal (SQLAlchemy, the node loop) and, with the default jnp
attention, runs no Pallas kernel: importing them cost its start 0.3 s each on this project's machine
(``python -X importtime``; docs/operations.md, "Start-up").
"""

from __future__ import annotations

import subprocess
import sys

import pytest

# what fsm-pd serve --role colocated imports (cli/serve.py's run_node), then an engine and its app built as it builds
# them: whatever they load on the way is in sys.modules at the end
NODE = """
import sys

import pytest
from fsm_pd.cli import serve
from fsm_pd.api import create_app
from fsm_pd.api.drain import serve_draining
from fsm_pd.model import compiles
from fsm_pd.model.loader import load_model
from fsm_pd.runtime.gc_policy import apply_serving_gc_policy
from fsm_pd.serving import warmup
from fsm_pd.serving.colocated_engine import ColocatedEngine
from fsm_pd.serving.startup import Startup

model = load_model("tiny")
engine = ColocatedEngine(model, num_pages=16, page_size=16)
app = create_app(engine, model.tokenizer, model_name="tiny", startup=Startup())
print(sorted({name.split(".")[0] if name.startswith("sqlalchemy") else name for name in sys.modules
              if name.startswith(("sqlalchemy", "jax.experimental.pallas", "fsm_pd.store.journal"))}))
engine.close()
"""


def test_a_colocated_node_starts_without_the_journal_or_pallas():
    out = subprocess.run([sys.executable, "-c", NODE], capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "[]", f"a colocated node's start loads {out.stdout.strip()}"


# what fsm-pd serve imports before it starts opening the device (cli/serve.py's serve_main up to DeviceOpening): the
# opening holds the interpreter for seconds on the chip, so what runs before it delays every start by its length
BEFORE_THE_OPEN = """
import sys

import pytest
from fsm_pd.cli import side_by_side

class Opened(Exception):
    pass

def opening(self, *args, **kwargs):
    print(sorted({name.split(".")[0] for name in sys.modules if name.startswith(("sqlalchemy", "jax"))}))
    raise Opened

side_by_side.DeviceOpening.__init__ = opening
from fsm_pd.cli.serve import serve_main
try:
    serve_main(sys.argv[1:])
except Opened:
    pass
"""


@pytest.mark.parametrize("role", ["pd", "decode"])
def test_a_journaling_role_starts_opening_the_device_before_it_imports_the_database_layer(role, tmp_path):
    """``--role pd`` began its open 0.8 s after a colocated node on the chip (round r13): its parser's retention
    flags imported SQLAlchemy first (``store/retention_flags.py``)."""
    argv = ["--role", role, "--model", "tiny", "--uds", str(tmp_path / "n.sock"), "--journal-dir", str(tmp_path)]
    if role == "decode":
        argv = [*argv[:-2], "--side-channel-secret", "ab" * 16]
    out = subprocess.run([sys.executable, "-c", BEFORE_THE_OPEN, *argv], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "[]", f"before the open: {out.stdout.strip()}"
