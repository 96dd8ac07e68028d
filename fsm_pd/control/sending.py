"""``PeerSenders``: the real ``SideChannelPort``. Side-channel sends leave the node loop's thread.

``SideChannel.send`` may wait up to its send timeout for a peer that is dead or not up yet. Called from the node
loop, that stalled every room of the node for a second per message. Here each peer address gets its own sender
thread with a FIFO queue: ``post`` only appends, messages to one peer keep their order (READY before ABORT), and a
dead peer delays nobody else. The outcome of every send comes back through its ``done`` callback, from the sender
thread; the handlers turn a failure into an ``error`` event.

When a send to a peer fails, every message already queued for that peer fails with the same error at once instead
of waiting out the timeout one by one: a dead peer costs one timeout per burst, not per message. A sender thread that
has been idle for ``idle_s`` exits; the next post to that peer starts a new one.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable
from typing import Any

from fsm_pd.effects.ports import SendDone

log = logging.getLogger(__name__)


class _Peer:
    __slots__ = ("queue", "thread")

    def __init__(self) -> None:
        self.queue: deque[tuple[Any, SendDone]] = deque()
        self.thread: threading.Thread | None = None


class PeerSenders:
    def __init__(self, channel: Any, *, idle_s: float = 30.0, name: str = "send"):
        """``channel``: a ``SideChannel`` (``address``, ``stamp``, blocking ``send``, ``forget_peer``)."""
        self.channel = channel
        self.idle_s = idle_s
        self.name = name
        self._peers: dict[str, _Peer] = {}
        self._cv = threading.Condition()
        self._closed = False

    @property
    def address(self) -> str:
        return self.channel.address

    def stamp(self, cls: type, **fields: Any) -> Any:
        return self.channel.stamp(cls, **fields)

    def forget_peer(self, addr: str) -> None:
        self.channel.forget_peer(addr)

    def post(self, addr: str, msg: Any, done: SendDone) -> None:
        with self._cv:
            if self._closed:
                return  # shutting down: nothing will be waiting for the answer
            peer = self._peers.get(addr)
            if peer is None:
                peer = self._peers[addr] = _Peer()
            peer.queue.append((msg, done))
            if peer.thread is None:
                peer.thread = threading.Thread(target=self._run, args=(addr, peer), daemon=True,
                                               name=f"{self.name}[{addr}]")
                peer.thread.start()
            self._cv.notify_all()

    def pending(self) -> int:
        """Messages queued and not yet handed to the side channel (for tests and counters)."""
        with self._cv:
            return sum(len(p.queue) for p in self._peers.values())

    def _run(self, addr: str, peer: _Peer) -> None:
        while True:
            with self._cv:
                if not peer.queue and not self._closed:
                    self._cv.wait_for(lambda: peer.queue or self._closed, timeout=self.idle_s)
                if self._closed or not peer.queue:
                    if self._peers.get(addr) is peer:  # idle (or closing): this thread ends, a later post starts one
                        del self._peers[addr]
                    peer.thread = None
                    return
                msg, done = peer.queue.popleft()
            try:
                self.channel.send(addr, msg)
            except Exception as exc:  # noqa: BLE001 - reported to the handler, which decides what it means
                with self._cv:
                    failed = [done, *(d for _, d in peer.queue)]
                    peer.queue.clear()
                for report in failed:
                    _report(report, exc)
            else:
                _report(done, None)

    def close(self) -> None:
        """Stop every sender thread; messages still queued are dropped (the process is going away)."""
        with self._cv:
            self._closed = True
            threads = [p.thread for p in self._peers.values() if p.thread is not None]
            self._cv.notify_all()
        for thread in threads:
            thread.join(timeout=5)


def _report(done: Callable[[BaseException | None], None], error: BaseException | None) -> None:
    try:
        done(error)
    except Exception:  # a bug in a callback must not kill the peer's sender thread
        log.exception("side-channel send callback failed")


_local: dict[str, Any] = {}  # side channels of this process that take messages directly, by address
_local_lock = threading.Lock()


class InProcessSenders(PeerSenders):
    """``PeerSenders`` for an engine whose peer lives in the same process (``--role pd``): a message to a side
    channel registered here is handed to it directly (``SideChannel.deliver``: its replay guard, observers and
    handler) on the posting thread, in order per peer, with no socket, MAC or sender thread; a message to any other
    address goes out as ``PeerSenders`` sends it. Both engines still journal every message they act on, so replay
    sees the same handoff."""

    def __init__(self, channel: Any, **options: Any) -> None:
        super().__init__(channel, **options)
        self._order: dict[str, threading.Lock] = {}
        with _local_lock:
            _local[channel.address] = channel

    def post(self, addr: str, msg: Any, done: SendDone) -> None:
        with _local_lock:
            peer = _local.get(addr)
            order = self._order.setdefault(addr, threading.Lock()) if peer is not None else None
        if peer is None or order is None:
            super().post(addr, msg, done)
            return
        with order:
            try:
                peer.deliver(msg)
            except Exception as exc:  # noqa: BLE001 - reported to the handler, as a failed send is
                _report(done, exc)
                return
        _report(done, None)

    def close(self) -> None:
        with _local_lock:
            _local.pop(self.channel.address, None)
        super().close()
