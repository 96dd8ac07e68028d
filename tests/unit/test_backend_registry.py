"""Backend registry: built-in names, in-code registration, the entry-point group, and clear errors."""

from __future__ import annotations

import sys
import textwrap

import pytest
from fake_backend import FakeTransferBackend
from real_parts import TCP

from fsm_pd.transport.backends import (
    ENTRY_POINT_GROUP,
    TransferBackend,
    UnknownBackendError,
    backend_names,
    create_backend,
    new_uuid,
    register_backend,
    unregister_backend,
)


def test_builtin_names_are_listed():
    assert {"jax", "zmq", "tcp", "fake"} <= set(backend_names())  # fake: registered by tests/conftest.py


def test_unknown_name_error_lists_known_backends():
    with pytest.raises(UnknownBackendError) as info:
        create_backend("carrier-pigeon")
    message = str(info.value)
    assert "carrier-pigeon" in message
    for name in ("fake", "jax", "zmq"):
        assert name in message
    assert isinstance(info.value, LookupError)


def test_create_passes_options_to_the_factory():
    seen = {}

    def factory(**opts):
        seen.update(opts)
        return FakeTransferBackend()

    register_backend("test-opts", factory)
    try:
        with create_backend("test-opts", alpha=1, beta="b") as backend:
            assert isinstance(backend, TransferBackend)
        assert seen == {"alpha": 1, "beta": "b"}
    finally:
        unregister_backend("test-opts")
    assert "test-opts" not in backend_names()


def test_duplicate_registration_needs_replace():
    register_backend("test-dup", FakeTransferBackend)
    try:
        with pytest.raises(ValueError, match="already registered"):
            register_backend("test-dup", FakeTransferBackend)
        register_backend("test-dup", "fake_backend:FakeTransferBackend", replace=True)
        with create_backend("test-dup") as backend:
            assert isinstance(backend, FakeTransferBackend)
    finally:
        unregister_backend("test-dup")


@TCP
def test_shadowing_a_builtin_and_unregistering_restores_it():
    from fsm_pd.transport.backends.tcp_backend import TcpTransferBackend

    class Marked(FakeTransferBackend):
        pass

    register_backend("tcp", Marked, replace=True)
    try:
        with create_backend("tcp") as backend:
            assert type(backend) is Marked
    finally:
        unregister_backend("tcp")
    with create_backend("tcp") as backend:
        assert type(backend) is TcpTransferBackend


@pytest.mark.parametrize("factory", [42, "no-colon-here", None])
def test_bad_factories_are_rejected_at_registration(factory):
    with pytest.raises(TypeError):
        register_backend("test-bad", factory)


def test_factory_returning_a_non_backend_fails_on_create():
    register_backend("test-wrong-type", lambda **_: object())
    try:
        with pytest.raises(TypeError, match="not a TransferBackend"):
            create_backend("test-wrong-type")
    finally:
        unregister_backend("test-wrong-type")


def test_entry_point_plugin_is_found_without_editing_fsm_pd(tmp_path, monkeypatch):
    """A separately installed distribution declares a backend in the entry-point group; create_backend finds it."""
    (tmp_path / "pigeon_transfer.py").write_text(
        textwrap.dedent(
            """
            from fake_backend import FakeTransferBackend

            class PigeonBackend(FakeTransferBackend):
                name = "pigeon"

                def __init__(self, *, speed="slow"):
                    super().__init__()
                    self.speed = speed
            """
        )
    )
    dist = tmp_path / "pigeon_transfer-1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: pigeon-transfer\nVersion: 1.0\n")
    (dist / "entry_points.txt").write_text(f"[{ENTRY_POINT_GROUP}]\npigeon = pigeon_transfer:PigeonBackend\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        assert "pigeon" in backend_names()
        with create_backend("pigeon", speed="fast") as backend:
            assert type(backend).__name__ == "PigeonBackend" and backend.speed == "fast"
    finally:
        sys.modules.pop("pigeon_transfer", None)


def test_new_uuid_is_63_bit_nonzero_and_fresh():
    uuids = {new_uuid() for _ in range(2000)}
    assert len(uuids) == 2000
    assert all(0 < u < 1 << 63 for u in uuids)


def test_publish_refuses_reused_or_invalid_uuids():
    import jax.numpy as jnp

    with create_backend("fake") as backend:
        uuid = new_uuid()
        backend.publish(uuid, [jnp.zeros(4)], 10)
        with pytest.raises(ValueError, match="never reused"):
            backend.publish(uuid, [jnp.zeros(4)], 10)
        backend.release(uuid)
        with pytest.raises(ValueError, match="never reused"):
            backend.publish(uuid, [jnp.zeros(4)], 10)
        for bad in (0, -1, 1 << 63, True, "7"):
            with pytest.raises(ValueError):
                backend.publish(bad, [jnp.zeros(4)], 10)
