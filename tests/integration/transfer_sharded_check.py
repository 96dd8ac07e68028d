"""Sharded staging through each network backend, in a process with 4 host devices (run by the integration tests).

    XLA_FLAGS=--xla_force_host_platform_device_count=4 python transfer_sharded_check.py jax

Publishes an array split 4 ways over its second axis and pulls it back over loopback (a) with the same sharding and
(b) as a replicated spec. Prints one JSON line: {"same": bool, "replicated": "ok" | "<error text>", "blame": ...}.
"""

from __future__ import annotations

import json
import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from fsm_pd.transport.backends import TransferFailed, create_backend, new_uuid


def main(backend_name: str) -> None:
    mesh = Mesh(np.array(jax.devices()), ("x",))
    split = NamedSharding(mesh, PartitionSpec(None, "x"))
    staging = jax.device_put(jnp.arange(8 * 16, dtype=jnp.float32).reshape(8, 16), split)
    result = {}
    with create_backend(backend_name) as node:
        uuid = new_uuid()
        node.publish(uuid, [staging], 30)
        (same,) = node.pull(
            node.address, uuid, [jax.ShapeDtypeStruct(staging.shape, staging.dtype, sharding=split)], 10
        )
        result["same"] = bool((same == staging).all()) and same.sharding == split
        uuid = new_uuid()
        node.publish(uuid, [staging], 30)
        replicated = jax.ShapeDtypeStruct(staging.shape, staging.dtype, sharding=NamedSharding(mesh, PartitionSpec()))
        try:
            (whole,) = node.pull(node.address, uuid, [replicated], 10)
            result["replicated"] = "ok" if bool((whole == staging).all()) else "wrong values"
        except TransferFailed as exc:
            result["replicated"], result["blame"] = exc.reason, exc.blame
    print(json.dumps(result))


if __name__ == "__main__":
    main(sys.argv[1])
