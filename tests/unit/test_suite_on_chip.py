"""The suite's settings for a TPU host (``tests/on_chip.py``, ``tests/real_parts.py``): what a process without TCP is
told, where children run jax, and the two jax settings a test asks for, set only where jax's default is not the CPU
and given back afterwards. The chip itself is faked here (a device whose platform says tpu)."""

from __future__ import annotations

import errno
import os
import socket
import sys
import threading
from types import SimpleNamespace

import jax
import on_chip
import pytest
import real_parts
import side_by_side


def test_tcp_is_missing_where_no_inet_socket_opens_or_loopback_does_not_connect(monkeypatch):
    assert real_parts.tcp_missing() == real_parts.TCP_MISSING  # this host's answer, whatever it is

    def refused(*args, **kwargs):  # a TPU host: socket(AF_INET, ...) itself fails
        raise OSError(errno.EAFNOSUPPORT, "Address family not supported by protocol")

    monkeypatch.setattr(socket, "socket", refused)
    assert "Address family not supported" in real_parts.tcp_missing()
    monkeypatch.undo()

    class Listener:  # a network namespace with loopback down: a socket binds and listens...
        def __init__(self, *args):
            pass

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            pass

        bind = listen = __init__

        def getsockname(self):
            return "127.0.0.1", 1

    def unreachable(*args, **kwargs):  # ... and nothing connects to it
        raise OSError(errno.ENETUNREACH, "Network is unreachable")

    monkeypatch.setattr(socket, "socket", Listener)
    monkeypatch.setattr(socket, "create_connection", unreachable)
    assert "Network is unreachable" in real_parts.tcp_missing()


@pytest.fixture
def environ(monkeypatch):
    """This process's environment as ``take_the_chip`` sees it, without JAX_PLATFORMS; the real one is untouched."""
    copy = {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"}
    monkeypatch.setattr(os, "environ", copy)
    return copy


def on_device(monkeypatch, platform: str, kind: str) -> None:
    monkeypatch.setattr(on_chip, "tpu_runtime_installed", lambda: True)
    monkeypatch.setattr(jax, "devices", lambda *backend: [SimpleNamespace(platform=platform, device_kind=kind)])


def test_without_a_tpu_runtime_jax_is_left_alone(monkeypatch, environ):
    monkeypatch.setattr(on_chip, "tpu_runtime_installed", lambda: False)
    assert on_chip.take_the_chip() is None
    assert "JAX_PLATFORMS" not in environ


def test_on_the_chip_children_run_jax_on_the_cpu(monkeypatch, environ):
    on_device(monkeypatch, "tpu", "TPU v5 lite")
    assert on_chip.take_the_chip() == ("jax: this process on TPU v5 lite (tpu); the processes tests start on the "
                                       "cpu")
    assert environ["JAX_PLATFORMS"] == "cpu"


def test_a_runtime_without_a_chip_changes_nothing(monkeypatch, environ):
    on_device(monkeypatch, "cpu", "cpu")
    assert on_chip.take_the_chip() == "jax: on the cpu, though a TPU runtime is installed"
    assert "JAX_PLATFORMS" not in environ


def test_on_a_cpu_the_settings_are_not_touched(monkeypatch):
    monkeypatch.setattr(on_chip, "_on_cpu", lambda: True)
    before = (jax.config.jax_default_device, jax.config.jax_default_matmul_precision)
    with on_chip.cpu_default(), on_chip.full_precision():
        assert (jax.config.jax_default_device, jax.config.jax_default_matmul_precision) == before


@pytest.mark.parametrize("name, context, value", [
    ("jax_default_device", on_chip.cpu_default, jax.devices("cpu")[0]),
    ("jax_default_matmul_precision", on_chip.full_precision, "highest"),
])
def test_off_the_cpu_a_setting_holds_in_every_thread_and_is_given_back(monkeypatch, name, context, value):
    import threading

    monkeypatch.setattr(on_chip, "_on_cpu", lambda: False)
    before = getattr(jax.config, name)
    with pytest.raises(KeyError), context():  # given back when the test fails, too
        seen = []
        thread = threading.Thread(target=lambda: seen.append(getattr(jax.config, name)))  # a model thread's view
        thread.start()
        thread.join()
        assert seen == [value] and getattr(jax.config, name) == value
        raise KeyError
    assert getattr(jax.config, name) == before


def test_a_module_at_full_precision_gets_programs_of_its_own(monkeypatch):
    """The serving programs are shared per process and pool shape (``programs.programs_for``): a module that asks
    for full precision must not run the ones an earlier module compiled for one bfloat16 pass (on the chip, PD and
    colocated answers then differed by more than any tie: test_serving_pd at concurrency 8)."""
    from fsm_pd.model.loader import load_model

    monkeypatch.setattr(on_chip, "_on_cpu", lambda: False)
    model = load_model("tiny")
    pool = model.make_pool(model.make_kv_layout(13, 4))  # a pool no other test makes: nothing compiled is touched
    default = model.programs(pool)
    with on_chip.full_precision():
        full = model.programs(pool)
        assert full is model.programs(pool) and full is load_model("tiny").programs(pool)  # shared as before
    assert full is not default and model.programs(pool) is default


def test_side_by_side_runs_at_once_keeps_the_order_and_raises_a_failure(monkeypatch):
    """``tests/side_by_side.py``: what the chip half compiles side by side comes back in order, as if one after the
    other, in brief turns of the interpreter's lock meanwhile; with 1 thread it all runs here."""
    monkeypatch.setenv(side_by_side.ENV, "3")
    together = threading.Barrier(3, timeout=30)  # passed only by three thunks running at once
    turns = []

    def thunk(i):
        together.wait()
        turns.append(sys.getswitchinterval())
        return i

    interval = sys.getswitchinterval()
    assert side_by_side.side_by_side([lambda i=i: thunk(i) for i in range(3)]) == [0, 1, 2]
    assert max(turns) < interval and sys.getswitchinterval() == interval

    def fails():
        raise ValueError("the second failed")

    with pytest.raises(ValueError, match="the second failed"):
        side_by_side.side_by_side([lambda: 1, fails, lambda: 3])
    monkeypatch.setenv(side_by_side.ENV, "1")
    assert side_by_side.side_by_side([threading.current_thread] * 2) == [threading.current_thread()] * 2
