"""The transfer-backend contract: how a staging pytree gets from the prefill node (P) to the decode node (D).

P ``publish``es the gathered staging arrays under a fresh uuid and holds them until D says PULLED (``release``),
until the hold expires, or until P gives up (``fail``). D ``pull``s them with a spec of what it expects. Every backend
keeps the same promises, because the state machines above it must turn every outcome into an event on time:

* ``pull`` returns or raises within ``timeout_s`` whatever the peer does (dead, silent, erroring, wrong uuid);
* it returns only arrays that are ready, error-free and shaped/typed as the spec says;
* once a hold ends (released, failed, expired) its memory is freed and a late pull fails fast instead of hanging.

Backends that stream host bytes (``progressive = True``) also let the two ends overlap their page copies with the
wire: P may publish a host staging array *before* it is filled (``publish_progressive``) and report how much of it
is final, and D may act on each array's final prefix while the rest is still arriving (``pull(on_progress=...)``).
Those that can also send a staging array straight from the pool's pages, without gathering it (``sends_pages =
True``: ``tcp``), take a ``PageSource`` (``publish_pages``).
"""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Literal, Protocol

from fsm_pd.runtime.random_bits import random_bits

if TYPE_CHECKING:  # annotations only: naming a backend must not import jax (the registry resolves lazily)
    import jax
    import numpy as np

Blame = Literal["remote", "local"]

# Transfer ids are random 63-bit ints: they fit int64 (JSON, msgpack, SQLite) as well as the uint64 the jax transfer
# server wants, and at this width a collision (which the jax server would turn into a silent data swap) is negligible.
UUID_BITS = 63


def new_uuid() -> int:
    """A fresh transfer id in ``[1, 2**63)``; 0 is never issued so that it can mean "none" in messages."""
    while True:
        value = random_bits(UUID_BITS)  # the OS's randomness in batches (runtime/random_bits.py)
        if value:
            return value


def check_uuid(uuid: int) -> int:
    if not isinstance(uuid, int) or isinstance(uuid, bool) or not 0 < uuid < 1 << UUID_BITS:
        raise ValueError(f"transfer uuid must be an int in [1, 2**{UUID_BITS}), got {uuid!r}")
    return uuid


def live_staging(staging: Sequence[jax.Array]) -> tuple[jax.Array, ...]:
    """The staging arrays as a tuple, each checked to be a live (not deleted or donated) ``jax.Array``."""
    import jax  # here, not at the top: naming or registering a backend must not import jax

    arrays = tuple(staging)
    for i, arr in enumerate(arrays):
        if not isinstance(arr, jax.Array) or arr.is_deleted():
            raise TypeError(f"staging[{i}] must be a live jax.Array, got {type(arr).__name__}")
    return arrays


class TransferError(Exception):
    """Base class of everything a backend raises about a transfer."""


class TransferTimeout(TransferError):
    """The pull did not complete within its deadline (peer silent, dead before answering, or never published)."""


# The reason of a pull whose entry the producer failed (its room ended: its own deadline or error, an abort): the
# prefill side gave up on the transfer, which the decode side takes as the peer's abort (``effects/pulls.py``)
PRODUCER_FAILED = "failed by producer"


class TransferFailed(TransferError):
    """The pull ended with an error.

    ``blame`` says who is at fault so that the state machine can record it: ``"remote"`` when the peer failed, went
    away or published an error; ``"local"`` when this node asked for something the peer did not publish (spec
    mismatch) or cannot receive it.
    """

    def __init__(self, reason: str, blame: Blame = "remote") -> None:
        if blame not in ("remote", "local"):
            raise ValueError(f"blame must be 'remote' or 'local', got {blame!r}")
        super().__init__(f"{reason} (blame: {blame})")
        self.reason = reason
        self.blame = blame


class BackendUnavailable(TransferError):
    """The backend cannot run in this process (missing library or API)."""


@dataclass(frozen=True, slots=True)
class OpenEntries:
    """P-side holds that are still pinning memory: for leak checks and metrics."""

    count: int
    nbytes: int


# on_progress(index, host, final_bytes): bytes [0, final_bytes) of pulled array ``index`` have landed in ``host``.
OnProgress = Callable[[int, "np.ndarray", int], None]


class StagingProgress:
    """What ``publish_progressive`` returns: P calls ``advance(n)`` once bytes ``[0, n)`` of the host array are final.

    The backend streams only final bytes, so a puller may arrive before the producer has written anything.
    """

    def __init__(self, host: np.ndarray, on_advance: Callable[[], None]) -> None:
        if not getattr(host, "flags", None) or not host.flags.c_contiguous:
            raise TypeError("a progressively published staging buffer must be a C-contiguous NumPy array")
        self.host = host
        self.nbytes = int(host.nbytes)
        self._final = 0
        self._on_advance = on_advance
        self._lock = threading.Lock()

    @property
    def final_bytes(self) -> int:
        return self._final

    def advance(self, nbytes: int) -> None:
        with self._lock:
            if not self._final <= nbytes <= self.nbytes:
                raise ValueError(f"final bytes may only grow within [{self._final}, {self.nbytes}], got {nbytes}")
            self._final = nbytes
        self._on_advance()


class PageSource(Protocol):
    """A staging array that was never gathered: its bytes are read from the pool's pages while they are sent
    (``fsm_pd.kernels.page_source.PoolPages``). One ``reader()`` per stream; a reader's ``send(sock, head, start,
    stop, check)`` writes ``head`` and then staging bytes ``[start, stop)`` without blocking and returns how many
    bytes went out, after ``check()`` (which raises once the hold has ended) passed where the pages cannot change."""

    shape: tuple[int, ...]
    dtype: Any
    nbytes: int

    def reader(self) -> Any: ...


class TransferBackend(ABC):
    """One node's end of the data plane. P uses the publish side, D the pull side; one object may do both.

    Thread safety: every method may be called from any thread. ``pull`` blocks, so callers run it on a worker thread.
    """

    name: ClassVar[str] = "?"
    progressive: ClassVar[bool] = False  # implements publish_progressive and calls pull's on_progress
    sends_pages: ClassVar[bool] = False  # implements publish_pages

    @property
    @abstractmethod
    def address(self) -> str:
        """What D passes to ``pull`` to reach this node's published entries."""

    @abstractmethod
    def publish(self, uuid: int, staging: Sequence[jax.Array], hold_timeout_s: float) -> None:
        """Make ``staging`` pullable under ``uuid`` until ``release``/``fail`` or ``hold_timeout_s`` seconds pass.

        The backend keeps its own references: the caller may drop its own, but must not delete or donate the arrays.
        Raises ``ValueError`` for a uuid that this node already used.
        """

    def publish_progressive(self, uuid: int, host: np.ndarray, hold_timeout_s: float) -> StagingProgress:
        """Publish the host array ``host`` while it is still being filled; stream each byte once it is final.

        Like ``publish`` (hold, release, fail, uuid rules), except that the caller keeps writing ``host`` in order
        and reports with the returned ``StagingProgress.advance``. A producer that gives up calls ``fail(uuid)``.
        Only backends with ``progressive = True`` implement it.
        """
        raise NotImplementedError(f"the {self.name} backend publishes finished arrays only; use publish()")

    def publish_pages(self, uuid: int, source: PageSource, hold_timeout_s: float) -> None:
        """Publish a staging array that is read from the pool's pages while it is sent (no gather copy).

        Like ``publish`` (hold, release, fail, uuid rules). The pages must stay the room's until the hold ends: the
        caller ends the hold (``release``/``fail``) before it frees them. Only backends with ``sends_pages = True``.
        """
        raise NotImplementedError(f"the {self.name} backend sends gathered arrays only; use publish()")

    @abstractmethod
    def release(self, uuid: int) -> None:
        """End the hold after D reported PULLED; a later pull of ``uuid`` fails fast. Unknown uuids are ignored."""

    @abstractmethod
    def fail(self, uuid: int, reason: str) -> None:
        """Replace the entry (published or not yet) with an error: pulls of ``uuid`` raise ``TransferFailed``."""

    @abstractmethod
    def open_entries(self) -> OpenEntries:
        """Holds that are still pinning memory."""

    def parked_pulls(self) -> frozenset[int] | None:
        """The uuids that pulls wait for here because they are not published yet (for tests that must act while a
        pull waits). None where the transport does not tell: ``jax``'s library parks pulls out of sight."""
        return None

    @abstractmethod
    def pull(self, address: str, uuid: int, spec: Sequence[jax.ShapeDtypeStruct], timeout_s: float,
             on_progress: OnProgress | None = None) -> tuple[jax.Array, ...]:
        """Fetch the arrays P published under ``uuid``; verified against ``spec`` before returning.

        ``spec`` gives shape and dtype of every array and optionally the sharding to put it on (default: this
        process's first device). Raises ``TransferTimeout`` or ``TransferFailed`` within ``timeout_s``.

        A progressive backend calls ``on_progress(index, host, n)`` on this thread whenever bytes ``[0, n)`` of
        array ``index`` have landed in ``host`` (its spec's shape and dtype), arrays in order. P's layout was checked
        against ``spec`` before the first byte was accepted and each chunk's length against the plan, but the pull
        may still fail later, after a prefix was reported. Other backends never call it.
        """

    def forget(self, address: str) -> None:  # noqa: B027 - optional hook, a no-op for connectionless backends
        """Drop any cached connection to ``address`` (the next pull connects fresh)."""

    @abstractmethod
    def close(self) -> None:
        """End every hold, drop connections, stop threads. Idempotent."""

    def __enter__(self) -> TransferBackend:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
