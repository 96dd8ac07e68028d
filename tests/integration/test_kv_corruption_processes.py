"""The KV checksum between two real processes over the ``tcp`` backend (``pd_node.py``: a ``KVManager`` per node).

A byte flipped on the wire (``FSM_PD_FAULT_CORRUPT_PULL`` on the decode node) fails the room with ``kv checksum
mismatch`` when the decode node checks (its pages are freed, P's staging released, replay explains it); with the
check off on the decode node the room succeeds and D's pages differ from P's: the corruption went through unnoticed.
P with the check off and D with it on: the handoff is not failed, and D records that P sent no checksum.
"""

from __future__ import annotations

import pd_harness
import pytest
from pd_harness import LARGE, assert_replay_consistent, final, transfer

from fsm_pd.kernels.kv_checksum import ALGORITHM_ENV
from fsm_pd.kernels.kv_hash import ALGORITHM as DEVICE_HASH
from fsm_pd.store import read_journal
from fsm_pd.store.replay import CHECKSUM_EXPLAINED

cluster = pd_harness.cluster  # the fixture: two pd_node.py processes
CORRUPT = {"FSM_PD_FAULT_CORRUPT_PULL": "1"}
PAGES = list(range(40, 104))  # 64 pages of 128 KiB over all layers: 8 MiB, several frames


@pytest.mark.parametrize("check", ["on", "off", f"on-{DEVICE_HASH}"])
def test_a_byte_flipped_on_the_wire(cluster, check):
    """``on-kvmix32``: both nodes checksum with the device hash (an accelerator pool's), computed on the CPU here."""
    check, _, algorithm = check.partition("-")
    env = {ALGORITHM_ENV: algorithm} if algorithm else {}
    p = cluster("prefill", "tcp", LARGE, env=env)
    d = cluster("decode", "tcp", LARGE, env={**CORRUPT, **env}, kv_checksum=check == "on")
    transfer(p, d, 1, PAGES)
    outcome = d("wait", room=1, timeout=60)
    assert p("wait", room=1, timeout=60)["state"] == outcome["state"]
    if check == "on":
        assert outcome["state"] == "Failed", outcome
        assert outcome["reason"].startswith("remote error: kv checksum mismatch: piece 0 layer 0: "), outcome
        counters = d("counters")
        assert counters["pages_reserved"] == 0 and counters["pulled_awaiting_scatter"] == 0
    else:
        assert outcome["state"] == "Success", outcome
        assert d("digest", room=1)["digest"] != p("digest", room=1, pages=PAGES)["digest"]  # went through
    p.stop(), d.stop()
    result = assert_replay_consistent(p.journal, d.journal)
    published = next(r for r in read_journal(p.journal) if r.room == 1 and r.trigger == "published").event
    # P sums only for a decode node that checks (PREPARE says so); over tcp the values follow the data as an entry
    assert published.get("checksum_entry") == (1 if check == "on" else None) and "kv_checksum" not in published
    assert published.get("kv_checksum_algorithm") == ((algorithm or "crc32c") if check == "on" else None)
    if check == "on":
        assert all(CHECKSUM_EXPLAINED in r.why for r in result.rooms if r.room == 1)


def test_no_checksum_from_the_prefill_node_is_not_a_failure(cluster):
    p = cluster("prefill", "tcp", LARGE, kv_checksum=False)
    d = cluster("decode", "tcp", LARGE)
    transfer(p, d, 1, PAGES)
    assert d("wait", room=1, timeout=60)["state"] == "Success"
    assert d("digest", room=1)["digest"] == p("digest", room=1, pages=PAGES)["digest"]
    p.stop(), d.stop()
    state, *_ = final(d.journal, 1)
    scattered = next(r for r in read_journal(d.journal) if r.room == 1 and r.trigger == "scattered")
    assert state == "Success" and scattered.event["kv_checksum_check"] == "missing"
