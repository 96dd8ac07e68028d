"""Writing a pull's layers into the pool while the rest is still on the wire: the bookkeeping, without jax.

``LayerStream`` is the D side of an overlapped handoff (``overlap.py``) minus the arrays. A progressive backend
reports, on the pulling thread, how many bytes of the staging array are final (``on_progress``). Once the last byte
of a group of layers is in, the group is handed to the model thread as its own write job while later layers are
still arriving; when the pull returns only the last group is left (``written`` waits for it).

Why D may write before the pull has finished, and why it never writes a page it gave back:

* the bytes of a finished layer never change again, and P's layout was checked against ours before any byte was
  accepted (``pull``'s contract), so a layer is written from exactly what P gathered;
* every write is a job on the model thread, the one FIFO that also frees pages. ``cancel`` is called from the job
  that frees the pages, so a layer that lands after a failure or abort finds the stream cancelled and writes nothing
  (SGLang issue 24527);
* a pull that fails half-way leaves some layers of *our own reserved* pages written; the room fails and those pages
  are freed, like any other garbage in a free page.

What a write is belongs to the pool: ``overlap.StreamedScatter`` stages and writes jax arrays; the simulation
(``fsm_pd.sim.kv``) checks each write against who holds the pages. Both run this class's decisions.
"""

from __future__ import annotations

from concurrent.futures import Future
from functools import partial
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from fsm_pd.effects.ports import ModelExecutor


class LayerStream:
    """Scatter one pulled staging array of ``num_layers`` layers of ``layer_bytes`` each into ``pages``, ``group``
    layers per write job on ``model``."""

    def __init__(self, model: ModelExecutor, pages: list[int], *, num_layers: int, layer_bytes: int, group: int):
        if group < 1 or num_layers % group:
            raise ValueError(f"a group of {group} layers does not divide {num_layers} layers")
        self.model, self.pages = model, list(pages)
        self.num_layers, self.layer_bytes, self.group = num_layers, layer_bytes, group
        self.submitted = 0  # layers handed to the model thread, always a prefix
        self.cancelled = False  # set and read on the model thread only
        self.error: BaseException | None = None

    # --- what the pool does: subclasses ---
    def stage(self, host: Any, layer: int) -> Any:
        """Pulling thread: layers ``[layer, layer + group)`` of ``host``, ready to be written (final from now on)."""
        raise NotImplementedError

    def write(self, owner: Any, layer: int, staged: Any) -> None:
        """Model thread: write ``staged`` (``stage``'s result) into ``self.pages`` of ``owner``'s pool."""
        raise NotImplementedError

    def wait(self, owner: Any) -> None:
        """Model thread, after the last write job: until the pool holds every write."""

    def checksums(self, owner: Any) -> list[list[int]] | None:
        """Model thread, in the job right after the last write: the pages' KV checksum taken from the bytes as they
        landed, if nothing else can have written the pages since; None: compute it from the pages now."""
        return None

    # --- the stream ---
    @property
    def complete(self) -> bool:
        """Every layer has been handed to the model thread."""
        return self.submitted == self.num_layers

    def on_progress(self, index: int, host: Any, final_bytes: int) -> None:
        """The backend's ``on_progress`` hook (pulling thread): queue every group of layers that has fully landed."""
        if index != 0:
            return
        landed = min(final_bytes // self.layer_bytes, self.num_layers)
        while self.submitted + self.group <= landed:
            layer = self.submitted
            self.model.submit(partial(self._write, layer, self.stage(host, layer)))
            self.submitted += self.group

    def _write(self, layer: int, staged: Any, owner: Any) -> None:
        if self.cancelled or self.error is not None:
            return
        try:
            self.write(owner, layer, staged)
        except Exception as exc:  # noqa: BLE001 - reported by written(), on the room
            self.error = exc

    def written(self, owner: Any) -> None:
        """On the model thread, after every write job: raise the first write's error, else wait for the pool."""
        if self.error is not None:
            raise self.error
        if self.cancelled:
            raise RuntimeError("the streamed scatter was cancelled")
        if not self.complete:
            raise RuntimeError(f"only {self.submitted} of {self.num_layers} layers were handed over")
        self.wait(owner)

    def finish(self) -> Future:
        """Queue ``written`` behind every write job; its future resolves once all layers are in the pool."""
        return self.model.submit(self.written)

    def cancel(self) -> None:
        """Call on the model thread before the pages are freed: writes still queued become no-ops."""
        self.cancelled = True
