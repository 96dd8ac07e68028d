"""A model read on a thread of its own, from a node's first second, while the rest of its start goes on.

A node's start has parts that wait on different things: the imports on the interpreter, the accelerator's opening on
the device (6 to 15 s for a TPU), the model's files on the disk (a GGUF conversion: seconds of CPU), the programs on
the compiler. One after the other they add up; this takes the model's part off the node's main thread:

1. the config and the tokenizer are read first (a converted entry's ``meta.json``, or the GGUF file's metadata), and
   the node builds its engine and prepares its programs from them: a program is compiled from the weights' shapes
   and dtype, not their values (``params.abstract_params``);
2. meanwhile the weights are read into host arrays (a converted entry, already in the serving dtype and layout, or
   the GGUF conversion), which needs no device, and put on the device once it is open;
3. the node waits for them (``LoadedModel.wait_for_weights``) just before it says it is ready.

A GGUF model (a named one or a file) is read so; the tiny model, an HF directory and a model split over devices
(``--tp``) load whole on the main thread, as before (``applies``).
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future

from fsm_pd.model.config import ModelConfig
from fsm_pd.model.tokenizer import Tokenizer


def applies(spec: str, tp: int = 1) -> bool:
    """Whether ``spec`` is read meanwhile: a GGUF model on one device. Raises ``FileNotFoundError`` for a named
    model whose package is missing (the node's one-line refusal)."""
    from fsm_pd.model.loader import gguf_source

    return tp == 1 and gguf_source(spec) is not None


class ModelMeanwhile:
    """Reads ``spec`` in ``dtype`` on a thread started at once: ``model()`` waits for its config and tokenizer only,
    and hands out the model with its weights to come (``pending``). ``seconds``: how long each part took on that
    thread, once done (``model``: to the config and tokenizer; ``weights``: to the weights on the device)."""

    def __init__(self, spec: str, dtype: str, *, progress: bool = False):
        self.spec, self.dtype, self.progress = spec, dtype, progress
        self.seconds: dict[str, float] = {}
        self.handed = None  # the model ``model()`` handed out
        self._placing = threading.Lock()  # held while the weights go onto the device (``free_bytes``)
        self._placed = False
        self._parts: Future = Future()  # (name, config, tokenizer)
        self._weights: Future = Future()  # the parameter tree, on the device
        self._started = time.monotonic()
        self.began = time.time()  # the same instant, on the clock start-up timelines use
        self._thread = threading.Thread(target=self._run, name="weights", daemon=True)
        self._thread.start()

    def model(self, timeout: float | None = None):
        """The model as soon as its config and tokenizer are read, its ``params`` the weights' shapes on JAX's
        first device until ``wait_for_weights``. Raises what reading them raised."""
        import jax

        from fsm_pd.model.loader import LoadedModel
        from fsm_pd.model.params import abstract_params

        if self.handed is not None:
            return self.handed
        name, config, tokenizer = self._parts.result(timeout)
        placed = jax.sharding.SingleDeviceSharding(jax.devices()[0])  # where ``jax.device_put`` puts the weights
        self.handed = LoadedModel(name, config, abstract_params(config, placed), tokenizer, pending=self._weights)
        return self.handed

    def free_bytes(self, device) -> int:
        """The memory ``device`` has free once the weights are on it, whether or not they are yet (``--role pd``
        sizes its pools from it without waiting for them): exact, as the weights' transfer holds the lock read
        under here, so they are either all there or none."""
        from fsm_pd.model.params import abstract_params, count_params

        name, config, tokenizer = self._parts.result()
        with self._placing:
            stats = device.memory_stats()
            free = stats["bytes_limit"] - stats.get("bytes_in_use", 0)
            return free if self._placed else free - count_params(abstract_params(config)) * _itemsize(config.dtype)

    def join(self, timeout: float | None = None) -> None:
        """Wait for the thread to end, whatever it read (a model read in a dtype nobody wants after all)."""
        self._thread.join(timeout)

    def _run(self) -> None:
        try:
            import jax

            from fsm_pd.model.loader import gguf_source, load_gguf

            path, name = gguf_source(self.spec)
            label = name or str(path)  # what ``load_gguf`` names it

            def told(config: ModelConfig, tokenizer: Tokenizer) -> None:
                if not self._parts.done():
                    self.seconds["model"] = time.monotonic() - self._started
                    self._parts.set_result((label, config, tokenizer))
                elif self._parts.result()[1] != config:  # told again: an unreadable entry, converted anew
                    raise ValueError(f"the converted model of {self.spec} holds another config than the file")

            def place(host: dict) -> dict:
                with self._placing:
                    params = jax.block_until_ready(jax.device_put(host))  # one transfer, waited for
                    self._placed = True
                return params

            model = load_gguf(path, dtype=self.dtype, progress=self.progress, name=name, on_parts=told, place=place)
            self.seconds["weights"] = time.monotonic() - self._started
            self._weights.set_result(model.params)
        except BaseException as exc:  # noqa: BLE001 - the node's threads hear it through the futures
            for future in (self._parts, self._weights):
                if not future.done():
                    future.set_exception(exc)


def _itemsize(dtype: str) -> int:
    import jax.numpy as jnp

    return jnp.dtype(dtype).itemsize
