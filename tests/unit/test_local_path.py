"""A node's local path (``fsm_pd/serving/local_path.py``) runs on programs its ready set already holds: a request the
router sends whole must not compile while serving, on a decode node or on a prefill node that serves both roles."""

from __future__ import annotations

from fsm_pd.serving.decode_engine import DecodeEngine
from fsm_pd.serving.prefill_engine import PrefillEngine
from fsm_pd.serving.warmup import plan_for


def _decode_shapes(shapes) -> set:
    return {shape for shape in shapes if shape[1] == 1}


def test_the_ready_sets_cover_a_local_prefill_and_its_decode():
    engines = {"prefill": PrefillEngine("tiny", num_pages=64, bootstrap_port=None),
               "both": PrefillEngine("tiny", num_pages=64, bootstrap_port=None, serve_local=True),
               "decode": DecodeEngine("tiny", num_pages=64)}
    try:
        plans = {name: plan_for(engine) for name, engine in engines.items()}
        assert not _decode_shapes(plans["prefill"].forward)  # a prefill node that does not decode compiles no step
        for name in ("both", "decode"):
            ready = plans[name].ready_forward
            # the single-row decode step, and the longest single-row prefill that covers every local prompt
            assert (1, 1) in ready
            longest = max(tokens for rows, tokens in plans[name].forward if rows == 1 and tokens > 1)
            assert (1, longest) in ready and longest >= engines[name].recompute.max_tokens
        assert plans["both"].gather_buckets == plans["prefill"].gather_buckets  # still a prefill node's transfers
    finally:
        for engine in engines.values():
            engine.close()
