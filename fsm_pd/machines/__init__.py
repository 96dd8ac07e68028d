"""The declared KV-transfer machines: states, tables, guards, effect descriptions. No I/O lives here.

Nothing under ``fsm_pd.machines`` imports zmq, jax, sqlalchemy, fastapi, time or random (a test enforces it):
that is what lets a journal be replayed through exactly the code that wrote it.
"""

from fsm_pd.machines import effect_types
from fsm_pd.machines.machine import Decision, Room, TransferMachine, failure_reason
from fsm_pd.machines.receiver import DEADLINES as RECEIVER_DEADLINES
from fsm_pd.machines.receiver import HANDOVERS as RECEIVER_HANDOVERS
from fsm_pd.machines.receiver import RECEIVER_TRANSITIONS
from fsm_pd.machines.sender import DEADLINES as SENDER_DEADLINES
from fsm_pd.machines.sender import SENDER_TRANSITIONS
from fsm_pd.machines.states import INITIAL, TERMINAL, KVPoll

# Built (and graph-checked) once at import: a broken table fails loudly before anything runs.
SENDER = TransferMachine("prefill", SENDER_TRANSITIONS, SENDER_DEADLINES)
RECEIVER = TransferMachine("decode", RECEIVER_TRANSITIONS, RECEIVER_DEADLINES, RECEIVER_HANDOVERS)
MACHINES = {"prefill": SENDER, "decode": RECEIVER}

__all__ = [
    "INITIAL",
    "MACHINES",
    "RECEIVER",
    "RECEIVER_DEADLINES",
    "RECEIVER_HANDOVERS",
    "RECEIVER_TRANSITIONS",
    "SENDER",
    "SENDER_DEADLINES",
    "SENDER_TRANSITIONS",
    "TERMINAL",
    "Decision",
    "KVPoll",
    "Room",
    "TransferMachine",
    "effect_types",
    "failure_reason",
]
