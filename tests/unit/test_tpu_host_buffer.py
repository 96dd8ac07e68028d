"""A node asks libtpu for a small premapped host buffer before jax opens a TPU, and never overrides a user's size."""

import contextlib
import logging

from fsm_pd.cli import serve
from fsm_pd.runtime.tpu_host_buffer import DEFAULT_BYTES, SIZE_ENV, ask_for_buffer


def test_a_tpu_start_asks_for_the_small_buffer():
    environ = {}
    assert ask_for_buffer("tpu", environ) == DEFAULT_BYTES
    assert environ == {SIZE_ENV: str(DEFAULT_BYTES)}
    assert DEFAULT_BYTES < 4 << 30  # smaller than libtpu's own default, whose mapping is what the open spent


def test_a_size_the_user_named_wins():
    environ = {SIZE_ENV: str(8 << 30)}
    assert ask_for_buffer("tpu", environ) is None
    assert environ == {SIZE_ENV: str(8 << 30)}


def test_other_platforms_are_left_alone():
    for platform in ("cpu", "gpu", "cuda"):
        environ = {}
        assert ask_for_buffer(platform, environ) is None
        assert environ == {}


def test_serve_asks_before_the_open_where_jax_will_start_on_a_tpu(monkeypatch, caplog):
    monkeypatch.setenv("JAX_PLATFORMS", "tpu")
    monkeypatch.delenv(SIZE_ENV, raising=False)
    with caplog.at_level(logging.INFO, logger="fsm_pd.serve"):
        serve.ask_for_host_buffer()
    import os

    assert os.environ[SIZE_ENV] == str(DEFAULT_BYTES)
    assert f"{DEFAULT_BYTES >> 20} MiB" in caplog.text


def test_serve_leaves_a_cpu_start_alone(monkeypatch):
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    monkeypatch.delenv(SIZE_ENV, raising=False)
    serve.ask_for_host_buffer()
    import os

    assert SIZE_ENV not in os.environ


class Opened(Exception):
    pass


def test_serve_main_asks_before_it_starts_opening_the_devices(monkeypatch, tmp_path):
    import os

    from fsm_pd.cli import side_by_side

    seen = {}

    def opening():
        seen["size"] = os.environ.get(SIZE_ENV)
        raise Opened

    monkeypatch.setenv("JAX_PLATFORMS", "tpu")
    monkeypatch.delenv(SIZE_ENV, raising=False)
    monkeypatch.setattr(side_by_side, "DeviceOpening", opening)
    with contextlib.suppress(Opened):
        serve.serve_main(["--role", "colocated", "--model", "tiny", "--uds", str(tmp_path / "node.sock")])
    assert seen == {"size": str(DEFAULT_BYTES)}
