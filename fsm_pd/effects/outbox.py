"""Sending a room's side-channel message: fault injection, best-effort kinds, and failures as events.

Both roles send the same way; only who the peer is, which kinds are best effort, and the crash point after a kind
differ. The send itself never blocks the node loop (``SideChannelPort.post``); its outcome comes back later:
a message that cannot reach a live-looking peer fails the room (an ``error`` event, blame remote); a best-effort one
(ABORT, PULLED) to a dead peer is dropped, since the peer's own deadlines end its side.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from fsm_pd.transport.errors import PeerUnreachable, SideChannelError

if TYPE_CHECKING:
    from fsm_pd.effects import Node
    from fsm_pd.effects.faults import Faults
    from fsm_pd.effects.ports import SideChannelPort


class Outbox:
    def __init__(self, channel: SideChannelPort, faults: Faults, *, peer: str, best_effort: frozenset[str],
                 crash_after: Mapping[str, str]):
        self.channel, self.faults, self.peer = channel, faults, peer
        self.best_effort, self.crash_after = best_effort, dict(crash_after)

    def send(self, node: Node, room_id: int, addr: str, msg: Any, kind: str) -> None:
        """Send now, later (injected delay) or not at all (injected drop); the outcome arrives as an event."""
        delay = self.faults.message(kind)
        if delay is None:
            return  # dropped by fault injection, as a lossy network would
        if delay:
            self.faults.later(delay, lambda: self._post(node, room_id, addr, msg, kind))
            return
        self._post(node, room_id, addr, msg, kind)

    def _post(self, node: Node, room_id: int, addr: str, msg: Any, kind: str) -> None:
        self.channel.post(addr, msg, lambda error: self._sent(node, room_id, kind, error))

    def _sent(self, node: Node, room_id: int, kind: str, error: BaseException | None) -> None:
        if error is None:
            if kind in self.crash_after:
                self.faults.crash(self.crash_after[kind])
            return
        if isinstance(error, PeerUnreachable):
            if kind not in self.best_effort:
                node.submit(room_id, "error", {"blame": "remote", "reason": f"{self.peer} unreachable: {error}",
                                          "effect": "Send"})
        elif isinstance(error, SideChannelError):
            node.submit(room_id, "error", {"blame": "local", "reason": f"side channel: {error}", "effect": "Send"})
        else:
            node.submit(room_id, "error", {"blame": "local", "reason": f"sending {kind}: {error}", "effect": "Send"})
