"""The narrow ports the effect handlers talk to the world through. No jax, no zmq, no threads here.

A handler holds only the ports it needs, never the ``KVManager``. Each port has two implementations: the real one
(``KVManager`` wires them: ``sending.py``, ``workers.py``, ``jax_kv.py``, the transfer backend, the ``ModelThread``)
and a deterministic one in ``fsm_pd.sim`` driven by one seeded RNG and the virtual clock. So the simulation and the
property tests run exactly the handlers that serve.

Ports that would block (a send to a dead peer, a pull, a bootstrap lookup) are asynchronous: they return at once and
report through a ``done`` callback, from whichever thread the implementation uses. A handler's callback only hands the
outcome to the node as an event (``node.submit``), which is thread-safe.

| port | real | simulated |
| --- | --- | --- |
| clock and timers (``Node.clock``) | ``RealClock`` | ``VirtualClock`` |
| ``SideChannelPort`` | ``PeerSenders`` over the signed ZMQ ``SideChannel`` | ``fsm_pd.sim.network`` (the same frames) |
| ``PublishPort`` (prefill) | the transfer backend | ``fsm_pd.sim.transfer`` (the real ``HoldTable``, virtual clock) |
| ``PullPort`` (decode) | ``ThreadedPuller``: the backend on worker threads | ``fsm_pd.sim.transfer`` |
| ``ResolverPort`` (decode) | ``ThreadedResolver``: ``PrefillResolver`` (HTTP) on workers | the same, lookup in memory |
| ``ModelExecutor`` | ``ModelThread``: jobs in order on the thread owning the pool | ``fsm_pd.sim.model``: with delay |
| ``PrefillKV`` / ``DecodeKV`` | ``JaxKV``: the page kernels | ``fsm_pd.sim.kv``: records every buffer and write |
| ``Admission`` (decode) | ``SchedulerAdmission``: the decode engine's ``Preallocation`` | the same, pages recorded |

(A decode ``KVManager`` needs one. The transfer tests, which have no scheduler, pass a first-come allocator of their
own: ``tests/pool_admission.py``.)
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

if TYPE_CHECKING:
    from fsm_pd.effects import Node

log = logging.getLogger(__name__)
T = TypeVar("T")

# done(error): None once a live connection took the frame, else why it could not leave
SendDone = Callable[[BaseException | None], None]
# done(result, error): exactly one of them is None
ResultDone = Callable[[Any, BaseException | None], None]
# on_progress(index, host, final_bytes): the transfer backend's progress hook (``TransferBackend.pull``)
OnProgress = Callable[[int, Any, int], None]


class SideChannelPort(Protocol):
    """Signed messages to peers. ``post`` never blocks the caller: the node loop must not wait for a dead peer."""

    @property
    def address(self) -> str: ...

    def stamp(self, cls: type, **fields: Any) -> Any:
        """Build a message of class ``cls`` from this node (sender, nonce, send time filled in)."""

    def post(self, addr: str, msg: Any, done: SendDone) -> None:
        """Queue ``msg`` for ``addr``; messages to one peer leave in order. ``done`` reports how it went."""

    def forget_peer(self, addr: str) -> None:
        """Drop any connection cached for ``addr`` (a restarted peer is connected afresh)."""


class PublishPort(Protocol):
    """The prefill side of the transfer backend (``TransferBackend``'s publish half). None of these block."""

    name: str
    progressive: bool

    @property
    def address(self) -> str: ...

    def publish(self, uuid: int, staging: Sequence[Any], hold_timeout_s: float) -> None: ...

    def release(self, uuid: int) -> None: ...

    def fail(self, uuid: int, reason: str) -> None: ...


class PullPort(Protocol):
    """The decode side of the transfer backend, made asynchronous."""

    def pull(self, address: str, uuid: int, page_count: int, timeout_s: float, *, done: ResultDone,
             on_progress: OnProgress | None = None, delay_s: float = 0.0, piece: Any = None) -> None:
        """Start pulling the staging array published under ``uuid``; ``done(staging, None)`` with a verified array of
        ``page_count`` pages (bucketed), or ``done(None, error)`` with ``TransferTimeout``/``TransferFailed``/other.
        ``delay_s`` holds the pull back first (fault injection: a slow link). ``piece`` (``reshard.Piece``) says
        which piece of a resharding plan this is: its shape and the decode device it lands on."""


class ResolverPort(Protocol):
    def resolve(self, ctx: Mapping[str, Any], done: ResultDone) -> None:
        """Find the room's prefill node; ``done(found, None)`` with the fields to merge into the room's context
        (``prefill_addr``, ``peer``, and ``bootstrap_url`` when a bootstrap server was asked), or
        ``done(None, error)``."""


class ModelExecutor(Protocol):
    """Runs ``job(owner)`` in submission order on the one thread that owns the KV pool (``owner.pool``)."""

    def submit(self, job: Callable[[Any], T]) -> Future[T]: ...


def run_kv_job(model: ModelExecutor, kv: PrefillKV | DecodeKV, job: Callable[[Any], T]) -> Future[T] | Settled:
    """A handoff's gather or scatter: on the model thread, in order with every other job on the pool, where it copies
    KV. A shared pool's handoff copies none (``kv.on_model_thread`` False: it moves page ownership under the
    allocator's own lock, ``control/pool_kv.py``), so it runs now, on the caller's thread, rather than wait behind a
    model step for nothing; its outcome still comes back through the returned future, one already settled."""
    if kv.on_model_thread:
        return model.submit(job)
    try:
        return Settled(job(model))
    except Exception as exc:  # noqa: BLE001 - reported through the future, as the model thread reports a job's
        return Settled(None, exc)


class Settled:
    """What a ``Future`` tells of a job that already ran (``run_kv_job`` on the spot): its result or exception, and
    callbacks called at once. A ``concurrent.futures.Future`` made, set and read for this took 8 us, its condition
    and lock for waiters that cannot exist, twice a ``--role pd`` handoff."""

    __slots__ = ("_exception", "_result")

    def __init__(self, result: Any, exception: BaseException | None = None) -> None:
        self._result, self._exception = result, exception

    def done(self) -> bool:
        return True

    def cancelled(self) -> bool:
        return False

    def result(self, timeout: float | None = None) -> Any:
        if self._exception is not None:
            raise self._exception
        return self._result

    def exception(self, timeout: float | None = None) -> BaseException | None:
        return self._exception

    def add_done_callback(self, fn: Callable[[Settled], object]) -> None:
        try:
            fn(self)
        except Exception:  # as a Future does: a callback's failure is logged, never raised into the job's caller
            log.exception("exception calling callback for %r", self)


class PrefillKV(Protocol):
    """The prefill node's pool operations; ``owner`` is the model executor's owner object, passed to every job."""

    on_model_thread: bool  # False: a handoff's jobs touch no device array, and run where they are asked (run_kv_job)

    def gather(self, owner: Any, pages: list[int], plan: Any) -> tuple:
        """Copy ``pages`` of every layer into staging, cut into the pieces of ``plan`` (``reshard.ReshardPlan``; one
        piece, the whole staging, without tensor parallelism): arrays with ``.shape[1]`` rows and ``.nbytes``, in plan
        order, ready on return."""

    def checksum_later(self, owner: Any, pages: list[int], plan: Any,
                       done: Callable[[list[list[int]] | None], None]) -> None:
        """Model thread, in the job that published ``pages``: ``sent_checksum`` of them as this job leaves them,
        computed while the send reads them (on another thread, nothing writing them meanwhile); ``done(sums)`` from
        whichever thread computed it."""

    def gathers_progressively(self, owner: Any) -> bool:
        """Whether ``publish_while_gathering`` can be used on this pool (a progressive backend is also needed)."""

    @property
    def summed(self) -> bool:
        """Whether this pool's KV can be checksummed here (``sent_checksum`` gives values, not None): where it
        cannot, a handoff announces and publishes no checksum at all."""

    @property
    def checksum_algorithm(self) -> str | None:
        """The name of the function ``sent_checksum`` computes (READY announces it with the values)."""

    def publish_while_gathering(self, owner: Any, transfer: PublishPort, uuid: int, pages: list[int],
                                hold_timeout_s: float, on_published: Callable[[int], None]) -> None: ...

    def discard(self, staging: Any) -> None:
        """A staging array that will never be published: let it go."""

    def trailer(self, words: list[int]) -> Any:
        """A chunked handoff's trailer holding ``words`` (int32: the first token, then any checksums), ready to
        publish."""

    def sent_checksum(self, owner: Any, pages: list[int], plan: Any) -> list[list[int]] | None:
        """Model thread, while ``pages`` hold the final KV a handoff sends: its checksum, one value per piece of
        ``plan`` (P's source slots) and layer (``kernels/kv_checksum.py``); None where this pool is not checksummed
        (on an accelerator)."""


class DecodeKV(Protocol):
    """The decode node's pool operations."""

    on_model_thread: bool  # as PrefillKV's

    def stream(self, pages: list[int]) -> Any | None:
        """A streamed scatter of a pull into ``pages`` (layers written as they land), or None to scatter at the end."""

    def complete_stream(self, stream: Any, staging: Any) -> bool:
        """Loop thread, before the final write is queued: hand the stream whatever the pull left; True if the stream
        writes the pages (the final job then only waits for it)."""

    def scatter(self, owner: Any, pieces: tuple, pages: list[int], stream: Any | None, plan: Any) -> list[int] | None:
        """Model thread: write the verified ``pieces`` of ``plan`` into ``pages`` (or wait for ``stream`` to have
        written them). A pool shared with the prefill side writes nothing: it adopts the sender's pages in place of
        ``pages`` and returns them (``control/pool_kv.py``); every other port returns None."""

    def cancel(self, stream: Any) -> None:
        """Model thread, before the pages are freed: the stream's writes still queued become no-ops."""

    def discard(self, staging: Any) -> None:
        """A pulled array that is done with or will never be scattered: let it go. Called once per pulled array."""

    def read_trailer(self, staging: Any) -> list[int]:
        """The words of a pulled trailer (``chunked.py``)."""

    def received_checksum(self, owner: Any, pages: list[int], plan: Any) -> list[list[int]] | None:
        """Model thread, after the handoff's writes into ``pages``: the checksum of what they hold now, in the order
        ``PrefillKV.sent_checksum`` uses (``plan``'s destination slots); None where this pool is not checksummed."""

    @property
    def checksum_algorithm(self) -> str | None:
        """The name of the function ``received_checksum`` computes: P's values are compared only if they name it."""

    def corrupt(self, staging: Any) -> Any:
        """``FSM_PD_FAULT_CORRUPT_PULL``: a pulled array with one byte flipped, wherever it lives (the given one is
        let go)."""


class Admission(Protocol):
    def request(self, node: Node, room: int, count: int | None) -> None: ...

    def release(self, node: Node, room: int) -> int: ...

    def counters(self) -> dict: ...
