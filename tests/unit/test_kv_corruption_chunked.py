"""The KV checksum of a chunked handoff (``effects/chunked.py``): P sums each piece when its chunk is final and sends
the values in the trailer; D verifies piece by piece over its pages. A byte flipped on the wire in a piece fails the
room naming the chunk piece, and D's recompute serves the undisturbed greedy tokens. Real engines, tiny model, tcp."""

from __future__ import annotations

import os
from unittest import mock

import pytest
from node_sockets import node_sockets
from on_chip import engines_on_cpu
from test_chunk_transfers import long_prompt
from test_chunked_prefill import CHUNK
from test_chunked_prefill import model as model  # noqa: F401 - the fixture: the tiny model with sharp attention
from test_serving_colocated import PAGE_SIZE, PAGES, ids_of, run
from test_serving_pd import assert_idle, pd_request
from test_transfer_recompute import both

from fsm_pd.effects.faults import FaultConfig, Faults
from fsm_pd.kernels.kv_checksum import ALGORITHM_ENV
from fsm_pd.kernels.kv_hash import ALGORITHM as DEVICE_HASH
from fsm_pd.serving.decode_engine import DecodeEngine
from fsm_pd.serving.prefill_engine import PrefillEngine
from fsm_pd.store import read_journal

# A node sums its KV (kernels/kv_checksum.py) only where its pool is on the CPU: on a TPU host these tests skip.
pytestmark = engines_on_cpu("the KV checksum is taken")


@pytest.mark.parametrize("algorithm", ["crc32c", DEVICE_HASH])
def test_a_byte_flipped_in_a_chunk_piece_is_caught(model, tmp_path, algorithm):  # noqa: F811 - the fixture
    """With crc32c (a CPU pool's) and with the device hash (an accelerator pool's, computed here on the CPU)."""
    with mock.patch.dict(os.environ, {ALGORITHM_ENV: algorithm}):  # read as each node starts
        p = PrefillEngine(model, num_pages=PAGES, page_size=PAGE_SIZE, backend="tcp", journal=str(tmp_path / "p.db"),
                          chunked_prefill_size=CHUNK, radix_cache=False,
                          **node_sockets(tmp_path, "p", bootstrap=True))
        d = DecodeEngine(model, num_pages=PAGES, page_size=PAGE_SIZE, backend="tcp", secret=p.secret,
                         journal=str(tmp_path / "d.db"), **node_sockets(tmp_path, "d"))
    try:
        prompt = long_prompt(model.tokenizer)
        clean_req = pd_request(p, "chunked-clean", prompt, max_new_tokens=6)
        _, clean = run(both(p, d, clean_req))
        assert clean[-1].meta.get("kv_recompute") is None
        d.manager.effects.faults = Faults(FaultConfig(corrupt_pull=1.0), role="decode")
        bad_req = pd_request(p, "chunked-bad", prompt, max_new_tokens=6)
        _, bad = run(both(p, d, bad_req))
        d.manager.effects.faults = Faults(role="decode")
        assert ids_of(bad) == ids_of(clean)
        assert "kv checksum mismatch: chunk piece 0 layer 0" in bad[-1].meta["kv_recompute"]["reason"]
        assert_idle(p, d)
    finally:
        d.close()
        p.close()
    rows = {(r.room, r.trigger): r for r in read_journal(tmp_path / "d.db")}
    pulled = rows[(clean_req.bootstrap.room, "pulled")].event
    assert len(pulled["chunks"]) > 1 and len(pulled["kv_checksum"]) == len(pulled["chunks"])  # one per piece
    assert rows[(clean_req.bootstrap.room, "scattered")].event["kv_checksum_check"] == "verified"
    assert rows[(clean_req.bootstrap.room, "kv_published")].event["kv_checksum_algorithm"] == algorithm
