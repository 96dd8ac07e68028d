"""The roles of a journal's rows that no machine fires: records (``Node.record``), each one row from the initial state
to Success or Failed, which replay checks a side of that role is (``replay.py``). Beside them, ``prefill`` and
``decode`` are the two machines' (``machines/sender.py``, ``receiver.py``).

- ``local``: a request a node prefilled itself (the router's ``fsm_pd_route`` local; ``serving/local_path.py``), with
  the router's reason, under the request's room.
- ``recompute``: a decode node prefilled the request of a room whose transfer failed (``serving/recompute.py``),
  under that room's id: Success when the request went on to decode, Failed when that prefill failed too.
- ``peer``: after the room had ended, the node found the peer process it was bound to dead or replaced
  (``control/peers.py``), under the room's id: what tells replay that the other side's journal stops because its
  node died (``causes.py``).
"""

from __future__ import annotations

LOCAL_ROLE, RECOMPUTE_ROLE, PEER_ROLE = "local", "recompute", "peer"
RECORD_ROLES = frozenset({LOCAL_ROLE, RECOMPUTE_ROLE, PEER_ROLE})
