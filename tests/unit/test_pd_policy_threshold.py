"""``--role pd``'s ``--pd-policy auto`` threshold (``pd_flags.local_prefill_max_tokens``): on one pool every prompt
the model takes is prefilled on the decode engine, since both routes run the same prefill in the same steps and the
handoff only adds its own cost (measured on a TPU v5e, ``docs/tpu.md``); with the roles on devices of their own, the
router's default; a threshold the user names wins either way. Parsed from real command lines."""

from __future__ import annotations

import pytest

from fsm_pd.cli.flags import node_parser
from fsm_pd.cli.pd_flags import DEFAULT_LOCAL_PREFILL_MAX_TOKENS, local_prefill_max_tokens

MAX_CONTEXT = 8192


def threshold(*flags: str) -> int:
    args = node_parser("pd").parse_args(["--role", "pd", *flags])
    return local_prefill_max_tokens(args, MAX_CONTEXT)


@pytest.mark.parametrize(("flags", "expected"), [
    ((), MAX_CONTEXT),  # one pool, the default backend
    (("--transfer-backend", "pool"), MAX_CONTEXT),
    (("--prefill-devices", "1", "--decode-devices", "1"), DEFAULT_LOCAL_PREFILL_MAX_TOKENS),  # device to device
    (("--transfer-backend", "zmq"), DEFAULT_LOCAL_PREFILL_MAX_TOKENS),  # two pools in one process
    (("--local-prefill-max-tokens", "300"), 300),
    (("--local-prefill-max-tokens", "0", "--prefill-devices", "1", "--decode-devices", "1"), 0),
])
def test_auto_prefills_every_prompt_locally_on_one_pool_unless_told(flags, expected):
    assert threshold(*flags) == expected
