"""Imported first, before jax, by the tools that compile for a described TPU without opening one
(``tpu_compile.py``, ``words_plan.py``): jax stays on the CPU, libtpu is told what chip it describes (to spare its
warnings and its metadata query), and libtpu's one-process lockfile is waived. A compile-only process never opens a
chip, yet libtpu takes that lock at load: two such tools at once (pytest-xdist runs test_tpu_compile and
test_words_plan side by side) failed the second with "Internal error when accessing libtpu multi-process lockfile".
"""

import os

for _name, _value in (("JAX_PLATFORMS", "cpu"), ("TPU_ACCELERATOR_TYPE", "v5litepod-1"),
                      ("TPU_WORKER_HOSTNAMES", "localhost"), ("TPU_SKIP_MDS_QUERY", "1"),
                      ("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")):
    os.environ.setdefault(_name, _value)
