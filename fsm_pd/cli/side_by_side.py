"""What a node's start waits on, side by side: jax opening its devices, the model being read, the server's imports.

``fsm-pd serve`` starts two threads as soon as its command line is checked: one opens jax's devices
(``DeviceOpening``: 6 to 15 s for a TPU), the other reads the model (``model/meanwhile.py``: a GGUF model's config
and tokenizer first, then its weights into host arrays and onto the device once it is open). The main thread takes
the model with its weights to come (``start_model``), builds the engine, starts preparing the ready set from the
weights' shapes on the start-up thread, and imports and builds the HTTP app beside it; the start-up thread waits for
the weights (``weights_in``) and the app just before it marks the node ready. Each part's seconds are a start-up
phase: ``device``, ``model``, ``weights`` (``serving/startup.py``).
"""

from __future__ import annotations

import argparse
import logging
import sys
import threading
import time

from fsm_pd.cli.flags import expected_platform, resolve_dtype, resolve_page_size
from fsm_pd.runtime.process_exit import exit_now


class DeviceOpening:
    """jax's backend started on a thread of its own while the server's modules import and the model is read:
    opening a TPU takes a process 6 to 15 s, which would otherwise come after the imports. ``wait`` returns the
    seconds it took (importing jax included)."""

    def __init__(self) -> None:
        self.seconds: float | None = None
        self.began = time.time()
        self._done = threading.Event()
        threading.Thread(target=self._open, name="open-devices", daemon=True).start()

    def _open(self) -> None:
        began = time.monotonic()
        try:
            import jax

            jax.devices()
        except Exception:  # noqa: BLE001 - the main thread's own first use reports it
            pass
        finally:
            self.seconds = time.monotonic() - began
            self._done.set()

    def wait(self, timeout: float | None = None) -> float | None:
        self._done.wait(timeout)
        return self.seconds


def read_model_meanwhile(args: argparse.Namespace):
    """Turn the compile cache on (before anything compiles), then start reading the model on a thread of its own
    (``model/meanwhile.ModelMeanwhile``), in the dtype of the platform jax is expected to start on; None where the
    model loads whole on the main thread later (the tiny model, an HF directory, ``--tp``)."""
    from fsm_pd.model import meanwhile
    from fsm_pd.runtime import compile_cache

    compile_cache.enable(args.compile_cache or compile_cache.default_dir())
    try:
        if not meanwhile.applies(args.model, args.tp):
            return None
    except FileNotFoundError:  # the main thread's load says so, in its one line
        return None
    # no progress bar: the warm-up's runs beside it, and two bars at once garble a terminal (the log says when a
    # GGUF file is converted, and /startupz shows the phase)
    return meanwhile.ModelMeanwhile(args.model, resolve_dtype(args.dtype, expected_platform()))


def start_model(args: argparse.Namespace, startup, opening: DeviceOpening, reading):
    """The node's model once jax has opened its devices: ``reading``'s (its weights still loading) where it read in
    the dtype this platform serves in, else loaded whole here. Sets ``args.page_size`` for the platform and records
    the ``device`` and ``model`` phases (``weights`` too, for a model loaded whole). Raises what loading raised."""
    import jax

    from fsm_pd.model.loader import load_model

    platform = jax.default_backend()  # waits for the devices
    startup.record("device", opening.wait() or 0.0, opening.began)
    args.page_size = resolve_page_size(args.page_size, platform)
    dtype = resolve_dtype(args.dtype, platform)
    if reading is not None:
        model = reading.model()
        startup.record("model", reading.seconds.get("model", 0.0), reading.began)
        if reading.dtype == dtype:
            return model
        logging.getLogger("fsm_pd.serve").warning(
            "the model was read in %s, but jax started on %s, which serves in %s: loading it again",
            reading.dtype, platform, dtype)
        reading.join()
    with startup.phase("weights"):
        return load_model(args.model, dtype=dtype, progress=True, tp=args.tp)


def weights_in(model, startups, reading) -> None:
    """Wait for the weights of ``model``, where ``reading`` handed it out (``meanwhile.py``), and record the
    ``weights`` phase; weights that cannot be read end the process in one line, status 2, as they would have before
    it served. A model loaded whole has nothing to wait for (its phase is recorded)."""
    if reading is None or reading.handed is not model:
        return
    try:
        model.wait_for_weights()
    except (FileNotFoundError, ValueError) as exc:
        print(f"fsm-pd serve: cannot load model {reading.spec!r}: {exc}", file=sys.stderr)
        exit_now(2)
    for startup in startups:
        startup.record("weights", reading.seconds.get("weights", 0.0), reading.began)
