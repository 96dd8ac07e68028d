"""A prefill node that journals as fast as it can until it is killed: the victim of test_journal_crash.py.

``python crash_writer.py JOURNAL DURABILITY SEED``: opens the journal, recovers (fails the rooms a previous run left
unfinished, as a restarted node does), prints one JSON line ``{"recovered": [...], "first_room": N}`` once that
recovery is committed, and then loops for ever: every step creates a batch of rooms and moves a random selection of
the live ones one transition further (PREPARE, prefill done, published, PULLED, local aborts), so each group commit
carries rows of many rooms in every state. It never exits by itself; the test SIGKILLs it at a random moment.
"""

from __future__ import annotations

import json
import random
import sqlite3
import sys
import time

from fsm_pd.effects import EffectInterpreter, Node, VirtualClock
from fsm_pd.machines import SENDER
from fsm_pd.machines.effect_types import GatherAndPublish, ReleaseStaging, Send
from fsm_pd.store import Journal

NODE_ID = "prefill-0"
DEADLINES = {"bootstrap": 300.0, "waiting": 300.0, "pull_hold": 60.0}
LAYOUT = {"num_layers": 1, "num_pages": 64, "page_size": 4, "kv_heads": 1, "head_dim": 8}
BATCH = 8  # new rooms per step


def main() -> None:
    path, durability, seed = sys.argv[1], sys.argv[2], int(sys.argv[3])
    rng = random.Random(seed)
    published: list[int] = []
    # GatherAndPublish "publishes" at once; the peer is never contacted (no reply_to), so a Send on a failure path
    # fails with a KeyError, which the interpreter journals as an error event: harmless and replayable.
    interp = EffectInterpreter({GatherAndPublish: lambda node, room, e: published.append(room.room),
                                Send: lambda node, room, e: None, ReleaseStaging: lambda node, room, e: None})
    node = Node(NODE_ID, SENDER, Journal(path, durability=durability), interp, VirtualClock(time.time()), DEADLINES)
    recovered = node.recover()
    node.step()
    conn = sqlite3.connect(path)  # recovery keeps only unfinished rooms in memory: ask the journal for the last id
    next_room = (conn.execute("SELECT max(room) FROM transitions").fetchone()[0] or 0) + 1
    conn.close()
    print(json.dumps({"recovered": recovered, "first_room": next_room}), flush=True)

    live: dict[int, str] = {}  # room -> what it still needs: "prepare", "kv", "pulled"
    while True:
        for _ in range(BATCH):
            node.create(next_room, {"layout": LAYOUT, "pages": [1, 2, 3]})
            live[next_room] = "prepare"
            next_room += 1
        for room in published:
            node.submit(room, "published", {"uuid": room, "transfer_addr": "tcp://127.0.0.1:9"})
            live[room] = "pulled"
        published.clear()
        for room in rng.sample(sorted(live), k=min(len(live), 3 * BATCH)):
            need, roll = live[room], rng.random()
            if roll < 0.05:
                node.submit(room, "abort", {"reason": "client went away"})
                del live[room]
            elif need == "prepare":
                node.submit(room, "metadata_received", {"peer": "decode-0", "peer_layout": LAYOUT,
                                                        "peer_page_count": 3, "transfer_id": room})
                live[room] = "kv"
            elif need == "kv":
                node.submit(room, "kv_ready", {"first_token": 7})
                live[room] = "published"  # GatherAndPublish reports back on the next step
            elif need == "pulled":
                node.submit(room, "pull_done", {"peer": "decode-0"})
                del live[room]
        node.step()


if __name__ == "__main__":
    main()
