"""``runtime/random_bits.py``: the OS's randomness in batches, for nonces and transfer uuids."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from fsm_pd.runtime import random_bits as rb
from fsm_pd.transport.backends.base import new_uuid
from fsm_pd.transport.messages import new_nonce


def test_values_fill_their_width_and_a_batch_is_refilled_when_spent(monkeypatch):
    reads = []
    real = os.urandom
    monkeypatch.setattr(rb.os, "urandom", lambda n: reads.append(n) or real(n))
    source = rb.RandomBits(batch_bytes=64)  # 8 values a batch
    values = [source.bits(63) for _ in range(20)]
    assert reads == [64, 64, 64]  # 20 values: three batches, never a read per value
    assert len(set(values)) == 20 and all(0 <= v < 1 << 63 for v in values)
    assert max(values) >= 1 << 60  # the top bits are used (a shift the wrong way would leave them 0)
    assert all(0 <= source.bits(1) <= 1 for _ in range(100)) and {source.bits(1) for _ in range(200)} == {0, 1}
    with pytest.raises(ValueError):
        source.bits(65)


def test_nonces_and_transfer_uuids_come_from_the_batch(monkeypatch):
    reads = []
    real = os.urandom
    monkeypatch.setattr(rb.os, "urandom", lambda n: reads.append(n) or real(n))
    rb._shared.forget()
    ids = [new_nonce() for _ in range(100)] + [new_uuid() for _ in range(100)]
    assert len(set(ids)) == 200 and all(0 < v < 1 << 63 for v in ids)
    assert len(reads) == 1  # 200 ids from one 4 KiB read


FORKED = """
import os
from fsm_pd.runtime import random_bits as rb
rb.random_bits(63)  # the parent holds a batch with values left
read, write = os.pipe()
pid = os.fork()
if pid == 0:  # the child: its next values, to the parent
    os.write(write, ",".join(str(rb.random_bits(63)) for _ in range(8)).encode())
    os._exit(0)
os.close(write)
with os.fdopen(read) as pipe:
    child = {int(v) for v in pipe.read().split(",")}
os.waitpid(pid, 0)
parent = {rb.random_bits(63) for _ in range(8)}
print("shared", len(child & parent))
"""


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_forked_child_never_hands_out_its_parents_next_values():
    """In a process of its own, without jax's threads (a fork beside them may deadlock)."""
    done = subprocess.run([sys.executable, "-c", FORKED], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and done.stdout.split() == ["shared", "0"], done.stdout + done.stderr


def test_a_requests_id_seed_and_room_come_from_the_batch(monkeypatch):
    """Each read of ``os.urandom`` lets go of the interpreter's lock; on the TPU host the request id's ``uuid4`` and
    the seed's ``secrets.randbits`` held each request's planning about 3 ms (round r13). They draw from the batch."""
    from fsm_pd.api.requests import new_rid
    from fsm_pd.model.sampling_params import SamplingParams
    from fsm_pd.router.merge import new_room

    drawn = []
    batch = rb.RandomBits()
    monkeypatch.setattr(rb, "_shared", batch)
    monkeypatch.setattr(batch, "bits", lambda n, draw=batch.bits: drawn.append(n) or draw(n))
    rid, seed, room = new_rid(), SamplingParams().resolved_seed(), new_room()
    assert drawn == [64, 64, 31, 63]
    assert len(rid) == 32 and int(rid, 16) >= 0 and 0 <= seed < 2**31 and 0 <= room < 2**63
