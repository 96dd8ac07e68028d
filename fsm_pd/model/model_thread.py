"""The model thread: the one thread that reads and writes the KV pool.

Everything that touches the pool (a forward pass, a gather for a transfer, a scatter of pulled KV, freeing pages
that a queued scatter may still write) is a job on this thread, so jobs are ordered: a FreePages queued after a
Scatter runs after it, and pages can never be handed to another request while a write to them is pending.

A job that raises fails its own future and the thread goes on. Some failures leave nothing to go on with: the
process is out of memory, a job raised something that is not an ``Exception`` (``SystemExit``, ``KeyboardInterrupt``),
or the pool's buffers were lost (a failed call that had donated them, whether the job raised or contained the failure
and returned). Then the thread is *dead*: ``dead`` says why,
every queued and later job fails at once with ``ModelThreadDead``, and the ``on_death`` callbacks run (the engine
fails its requests, ``/health`` turns 503). A dead model thread is not restarted: its pool can no longer be trusted.

One exception to "only this thread reads the pool": a transfer stream may read pages between jobs while it holds
``lease`` (``kvpool/lease.py``), which every job waits for, so that no view of the pool is alive while a job donates it.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, TypeVar

from fsm_pd.kvpool.lease import PoolLease

log = logging.getLogger(__name__)

T = TypeVar("T")
_STOP = object()


class ModelThreadDead(RuntimeError):
    """The model thread died; nothing runs on it any more."""


class ModelThread:
    """Owns ``pool`` (a tuple of per-layer arrays); ``submit(job)`` runs ``job(self)`` on the model thread."""

    def __init__(self, pool: Any = None, name: str = "model", device: Any = None):
        """``device``: where the jobs' new arrays go by default (``jax.default_device``), for a model and pool
        placed on a device of their own (``--role pd --prefill-devices 1 --decode-devices 1``); None: JAX's."""
        self.pool = pool
        self.name = name
        self.device = device
        self.dead: str | None = None  # why the thread died; None while it serves
        self.on_death: list[Callable[[str], None]] = []  # called once, on the dying thread, with the reason
        self.lease = PoolLease()  # readers of the pool between jobs (a send straight from the pool's pages)
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()  # orders submit against death and close: no job is queued after the drain
        self._closed = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, job: Callable[[ModelThread], T]) -> Future[T]:
        future: Future[T] = Future()
        with self._lock:
            if self._closed:
                raise RuntimeError(f"{self.name} is closed: cannot schedule new jobs")
            if self.dead is not None:
                future.set_exception(ModelThreadDead(f"{self.name} is dead: {self.dead}"))
                return future
            self._jobs.put((job, future))
        return future

    def call(self, job: Callable[[ModelThread], T], timeout: float | None = None) -> T:
        """Run ``job`` on the model thread and wait for its result."""
        return self.submit(job).result(timeout)

    def health(self) -> str | None:
        """Why this thread cannot serve (None while it can)."""
        if self.dead is None and not self._closed and not self._thread.is_alive():
            return f"{self.name} exited"  # cannot happen through _run; reported rather than assumed
        return self.dead

    def close(self) -> None:
        """Stop after the job in progress; queued jobs are cancelled."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._jobs.put(_STOP)
        if threading.current_thread() is not self._thread:
            self._thread.join()

    # --- the model thread ---
    def _run(self) -> None:
        if self.device is None:
            self._serve()
            return
        import jax  # only a placed model thread needs it: this module stays jax-free for the simulation

        with jax.default_device(self.device):  # thread-local: this thread's uncommitted arrays land there
            self._serve()

    def _serve(self) -> None:
        while True:
            item = self._jobs.get()
            if item is _STOP:
                self._drain(None)
                return
            job, future = item
            if self._closed:
                future.cancel()
                continue
            if not future.set_running_or_notify_cancel():
                continue
            try:
                with self.lease.job():
                    result = job(self)
            except BaseException as exc:  # noqa: BLE001 - the job's failure is its caller's, unless it is fatal
                # dead before the caller hears of the failure: a caller that then asks health() must see why
                if (reason := self._fatal(exc)) is not None:
                    with self._lock:
                        self.dead = reason
                future.set_exception(exc)
                if reason is not None:
                    self._die(reason)
                    return
            else:
                future.set_result(result)
                # a job may contain a failure (one request's, ``serving/isolate.py``) whose call had donated the
                # pool: the job returns, and every later job would fail on the deleted buffers while /health says
                # 200. The layers are donated first to last, so the ends tell: two checks a job, not one a layer.
                if (reason := self._lost(_ends(_arrays(self.pool)), "a failure the job contained")) is not None:
                    self._die(reason)
                    return

    def _fatal(self, exc: BaseException) -> str | None:
        if not isinstance(exc, Exception) or isinstance(exc, MemoryError):
            return f"a job raised {type(exc).__name__}: {exc}"
        return self._lost(list(enumerate(_arrays(self.pool))), f"{type(exc).__name__}: {exc}")

    @staticmethod
    def _lost(arrays: list[tuple[int, Any]], after: str) -> str | None:
        """Why the pool can no longer serve, if any of ``arrays`` (index, array) was deleted."""
        if lost := [i for i, array in arrays if _deleted(array)]:
            return f"the KV pool was lost (layers {lost[:4]} deleted) after {after}"
        return None

    def _die(self, reason: str) -> None:
        with self._lock:
            self.dead = self.dead or reason
        log.critical("%s died: %s", self.name, reason)
        self._drain(ModelThreadDead(f"{self.name} is dead: {reason}"))
        for callback in list(self.on_death):
            try:
                callback(reason)
            except Exception:  # one listener's failure must not keep the others from hearing
                log.exception("an on_death callback of %s failed", self.name)

    def _drain(self, error: BaseException | None) -> None:
        """Fail (or, at close, cancel) every job still queued."""
        while True:
            try:
                item = self._jobs.get_nowait()
            except queue.Empty:
                return
            if item is _STOP:
                continue
            _, future = item
            if error is None or not future.set_running_or_notify_cancel():
                future.cancel()
            else:
                future.set_exception(error)


def _arrays(pool: Any) -> list:
    if isinstance(pool, (tuple, list)):
        return [a for item in pool for a in _arrays(item)]
    return [] if pool is None else [pool]


def _ends(arrays: list) -> list[tuple[int, Any]]:
    """The first and the last of ``arrays``, with their indices."""
    return [(i, arrays[i]) for i in sorted({0, len(arrays) - 1})] if arrays else []


def _deleted(array: Any) -> bool:
    is_deleted = getattr(array, "is_deleted", None)
    try:
        return bool(is_deleted()) if callable(is_deleted) else False
    except Exception:  # an array that cannot even say is as good as lost
        return True
