"""Sending a room's side-channel message: fault injection, best-effort kinds, and failures as events.

Both roles send the same way; only who the peer is, which kinds are best effort, and the crash point after a kind
differ. A message that cannot reach a live-looking peer fails the room (``EffectError``, blame remote); a best-effort
one (ABORT, PULLED) to a dead peer is dropped, since the peer's own deadlines end its side.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

from fsm_pd.effects import EffectError
from fsm_pd.transport import PeerUnreachable, SideChannelError

if TYPE_CHECKING:
    from fsm_pd.control.faults import Faults
    from fsm_pd.effects import Node
    from fsm_pd.transport import SideChannel


class Outbox:
    def __init__(self, channel: SideChannel, faults: Faults, *, peer: str, best_effort: frozenset[str],
                 crash_after: Mapping[str, str]):
        self.channel, self.faults, self.peer = channel, faults, peer
        self.best_effort, self.crash_after = best_effort, dict(crash_after)

    def send(self, node: Node, room_id: int, addr: str, msg, kind: str) -> None:
        """Send now, later (injected delay) or not at all (injected drop); raises EffectError when sending now."""
        delay = self.faults.message(kind)
        if delay is None:
            return  # dropped by fault injection, as a lossy network would
        if delay:
            self.faults.later(delay, lambda: self._send_later(node, room_id, addr, msg, kind))
            return
        self._send(addr, msg, kind)

    def _send_later(self, node: Node, room_id: int, addr: str, msg, kind: str) -> None:
        try:
            self._send(addr, msg, kind)
        except EffectError as exc:
            node.submit(room_id, "error", {"blame": exc.blame, "reason": exc.reason})

    def _send(self, addr: str, msg, kind: str) -> None:
        try:
            self.channel.send(addr, msg)
        except PeerUnreachable as exc:
            if kind in self.best_effort:
                return
            raise EffectError(f"{self.peer} unreachable: {exc}", blame="remote") from exc
        except SideChannelError as exc:
            raise EffectError(f"side channel: {exc}") from exc
        if kind in self.crash_after:
            self.faults.crash(self.crash_after[kind])
