"""A request's pages sent straight from the KV pool to a socket: the staging array's bytes, never gathered.

``PoolPages`` stands for the staging array ``[L, page_bucket(n), *page_shape]`` that a gather of ``pages`` would
build (padding rows hold page 0, as a gather's do) and hands a transfer stream its bytes as views of the pool's
pages, for one ``sendmsg`` each: the kernel's copy into the socket is then the only copy on the prefill node.

Where the views live, and why that is safe (the hazard: the model thread donates the pool at every step, and a
view alive across a donation makes XLA copy the whole pool, the view then reading the old buffer):

* a view exists only inside one ``PageReader.send``, under the model thread's ``PoolLease`` (no job runs meanwhile),
  and is dropped before the lease is: the send is non-blocking, so a job waits for at most one socket write;
* the caller's ``check`` runs under the same lease before any byte is read: the room's hold is still live, so its
  pages are not freed yet (the handlers end the hold before the model thread frees the pages, and freeing is a job);
* once a job has run between two of a stream's turns (a busy node: steps queue behind each other), the stream
  copies everything it has left out of the pool in that turn (``detach``), at most the gather it used to make, and
  sends the rest from that copy without the lease. On an idle node a stream never copies.
"""

from __future__ import annotations

import bisect
import math
import socket
from collections.abc import Callable
from typing import Any

import numpy as np

from fsm_pd.kernels.layout import PAD_PAGE, KVLayout
from fsm_pd.kernels.page_buckets import page_bucket

MAX_IOV = 512  # views per sendmsg (Linux refuses more than IOV_MAX = 1024)


class PoolPages:
    """The staging bytes of ``pages`` of ``owner.pool``, read in place under ``owner.lease``."""

    def __init__(self, owner: Any, pages: list[int], layout: KVLayout) -> None:
        self.owner, self.lease = owner, owner.lease
        rows = page_bucket(len(pages))
        self.shape = layout.staging_shape(rows)
        self.dtype = np.dtype(layout.dtype)
        self.page_bytes = math.prod(layout.page_shape) * self.dtype.itemsize
        self.layer_bytes = rows * self.page_bytes
        self.nbytes = layout.num_layers * self.layer_bytes
        row_pages = [*pages, *[PAD_PAGE] * (rows - len(pages))]
        # runs of rows whose pages are consecutive in the pool: (first row, first page, length)
        self._runs: list[tuple[int, int, int]] = []
        for row, page in enumerate(row_pages):
            if self._runs and page == self._runs[-1][1] + self._runs[-1][2] and page != PAD_PAGE:
                first_row, first_page, length = self._runs[-1]
                self._runs[-1] = (first_row, first_page, length + 1)
            else:
                self._runs.append((row, page, 1))
        self._run_rows = [run[0] for run in self._runs]
        self.sums: Any = None  # a kv_checksum.SendSums fed by the send, set in the publishing job (checksum_later)

    def reader(self) -> PageReader:
        """One stream's reader of these bytes."""
        return PageReader(self)

    def views(self, start: int, stop: int, limit: int = MAX_IOV) -> list[memoryview]:
        """Views of staging bytes ``[start, stop)`` in the pool (at most ``limit`` of them, so perhaps fewer bytes).
        Only under the lease, and drop them before it ends."""
        layers: dict[int, memoryview] = {}
        out: list[memoryview] = []
        pos = start
        try:
            while pos < stop and len(out) < limit:
                layer, offset = divmod(pos, self.layer_bytes)
                row, within = divmod(offset, self.page_bytes)
                first_row, first_page, length = self._runs[bisect.bisect_right(self._run_rows, row) - 1]
                take = min(stop - pos, (first_row + length) * self.page_bytes - offset)
                if layer not in layers:  # zero-copy on CPU; waits for the pool's pending writes
                    layers[layer] = memoryview(np.asarray(self.owner.pool[layer]).reshape(-1).view(np.uint8))
                source = (first_page + row - first_row) * self.page_bytes + within
                out.append(layers[layer][source : source + take])
                pos += take
        except BaseException:
            out.clear()  # a traceback keeps this frame alive: it must not keep views of the pool
            raise
        finally:
            layers.clear()
        return out


class PageReader:
    """Sends one stream's share of a ``PoolPages``, a non-blocking ``sendmsg`` at a time."""

    def __init__(self, source: PoolPages) -> None:
        self.source = source
        self.turn = source.lease.turn()
        self.started = False
        self.detached: np.ndarray | None = None  # the rest, copied out of the pool
        self.detached_at = 0  # the staging offset of detached[0]

    def send(self, sock: socket.socket, head: memoryview, start: int, stop: int, check: Callable[[], None]) -> int:
        """Send ``head`` then staging bytes ``[start, stop)``, as much as the socket takes now; bytes sent (0 when
        it is full). ``check`` raises if the stream must not send any more (the hold ended)."""
        if self.detached is None:
            deliver = None
            try:
                with self.source.lease.read(self.turn):
                    check()
                    if not (self.started and self.turn.waited):
                        self.started, self.turn.waited = True, False
                        sums = self.source.sums
                        if sums is not None and not sums.finished:
                            # the checksum is open: sum the bytes of this write first (a frame at most), so that the
                            # kernel's copy into the socket finds them in cache
                            deliver = sums.took(start, stop)
                        views = self.source.views(start, stop)
                        try:
                            return _send(sock, [head, *views])
                        finally:
                            views.clear()  # no view of the pool outlives the lease
                    deliver = self._detach(start)
            finally:
                if deliver is not None:
                    deliver()  # the checksum is complete: published outside the lease
        else:
            check()
        begin = start - self.detached_at
        return _send(sock, [head, memoryview(self.detached)[begin : begin + stop - start]])

    def _detach(self, start: int) -> Callable[[], None] | None:
        """Under the lease: copy staging bytes ``[start, end)`` out of the pool, into a warm host block (and sum
        them, if the checksum is still open: it is not, a job ran since the publish, but a copy costs nothing to
        offer). Returns the checksum's delivery if that completed it."""
        from fsm_pd.kernels.cpu_copy import warm_blocks  # jax: only a node that sends pages gets here

        block = warm_blocks.block(self.source.nbytes - start)
        views = self.source.views(start, self.source.nbytes, limit=1 << 30)
        try:
            at = 0
            for view in views:
                block[at : at + len(view)] = np.frombuffer(view, np.uint8)
                at += len(view)
        finally:
            views.clear()
        self.detached, self.detached_at = block, start
        return None if self.source.sums is None else self.source.sums.took(start, self.source.nbytes)


def _send(sock: socket.socket, buffers: list[memoryview]) -> int:
    try:
        return sock.sendmsg(buffers, (), socket.MSG_DONTWAIT)
    except BlockingIOError:
        return 0
    finally:
        buffers.clear()  # a traceback keeps this frame, and with it the list, alive after the lease has ended
