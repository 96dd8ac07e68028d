"""A serving process's malloc policy: glibc arenas capped at two (``fsm_pd.gc_policy.limit_malloc_arenas``)."""

from __future__ import annotations

import subprocess
import sys

ARENA_PROBE = """
import ctypes, ctypes.util, sys, tempfile, threading
from fsm_pd.gc_policy import limit_malloc_arenas
if sys.argv[1] == "capped":
    assert limit_malloc_arenas(2)
def churn():
    for _ in range(3000):
        blocks = [bytearray(64 * 1024) for _ in range(4)]  # above pymalloc's limit: glibc malloc serves these
        del blocks
threads = [threading.Thread(target=churn) for _ in range(16)]
[t.start() for t in threads]
[t.join() for t in threads]
libc = ctypes.CDLL(ctypes.util.find_library("c"))
libc.fopen.restype = ctypes.c_void_p
with tempfile.NamedTemporaryFile(suffix=".xml") as out:
    stream = ctypes.c_void_p(libc.fopen(out.name.encode(), b"w"))
    libc.malloc_info(0, stream)
    libc.fclose(stream)
    print(open(out.name).read().count("<heap nr="))
"""


def test_a_serving_process_caps_its_malloc_arenas():
    """Busy threads make glibc grow arenas of their own (the soak's RSS steps); a serving process caps them at two."""

    def arenas(mode: str) -> int:
        done = subprocess.run([sys.executable, "-c", ARENA_PROBE, mode], capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr
        return int(done.stdout.strip())

    assert arenas("capped") <= 2
    assert arenas("default") > 2, "without the cap the same threads make more: the probe can tell"
