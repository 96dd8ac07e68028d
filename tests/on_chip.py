"""The suite on a TPU host (``tests/on_tpu.sh``): what changes where jax's default device is a chip, not the CPU.

- The chip is this process's. One process at a time can open it (a second fails on libtpu's lockfile), so once
  this process has it, the child processes tests start (the mesh checks, nodes, the CLI) run jax on the CPU:
  ``take_the_chip`` puts ``JAX_PLATFORMS=cpu`` in the environment they inherit. jax reads that variable only when it
  starts its backends, so this process stays on the chip.
- A test of what only a CPU does (the block copies of ``impl="cpu"``, zero-copy views of the pool, checksums read
  from host memory) runs with the CPU as jax's default device: ``cpu_default``.
- A test that compares float32 results with a reference, or two paths of the model with each other, runs its
  float32 products at full precision: ``full_precision``. A TPU's default multiplies float32 in one bfloat16 pass,
  which agrees with a CPU to about three digits.

On a CPU machine none of this changes anything, and nothing is compiled again: a default device or a matmul
precision set explicitly is part of jit's cache key, so each is set only where it differs from what jax does anyway.
The settings are jax's global ones, not its thread-local contexts, because the engines compute on their model
threads.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import os
from collections.abc import Iterator


def tpu_runtime_installed() -> bool:
    """Whether jax can have a TPU here: its TPU runtime (the libtpu wheel, or a library named by TPU_LIBRARY_PATH)."""
    if "TPU_LIBRARY_PATH" in os.environ:
        return True
    try:
        importlib.metadata.distribution("libtpu")
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


def take_the_chip() -> str | None:
    """Where jax can have a TPU, start its backends now, before any test starts a child, and if this process got
    the chip, send the children to the CPU. Says where the tests' jax runs, for the run's last lines; None (and jax
    is not even imported) where no TPU runtime is installed, or where ``FSM_PD_SUITE_NO_CHIP`` is set (a run that a
    test of ``tests/on_tpu.sh`` starts, while the outer run's chip half holds the chip, which no second process can
    open)."""
    if os.environ.get("FSM_PD_SUITE_NO_CHIP") or not tpu_runtime_installed():
        return None
    import jax

    device = jax.devices()[0]
    if device.platform == "tpu":
        os.environ["JAX_PLATFORMS"] = "cpu"
        return f"jax: this process on {device.device_kind} ({device.platform}); the processes tests start on the cpu"
    return f"jax: on the {device.platform}, though a TPU runtime is installed"


def _on_cpu() -> bool:
    import jax

    return jax.default_backend() == "cpu"


@contextlib.contextmanager
def _global(name: str, value) -> Iterator[None]:
    import jax

    before = getattr(jax.config, name)
    jax.config.update(name, value)
    try:
        yield
    finally:
        jax.config.update(name, before)


@contextlib.contextmanager
def cpu_default() -> Iterator[None]:
    """jax's default device is the CPU meanwhile: arrays made without a device, and programs given only such arrays,
    go there. (``jax.devices()`` still lists the default backend's: a test pins those places itself.)"""
    if _on_cpu():
        yield
        return
    import jax

    with _global("jax_default_device", jax.devices("cpu")[0]):
        yield


@contextlib.contextmanager
def full_precision() -> Iterator[None]:
    """float32 products at full precision meanwhile ("highest"), where the default backend would round them."""
    if _on_cpu():  # a CPU multiplies float32 in float32 whatever the setting
        yield
        return
    with _global("jax_default_matmul_precision", "highest"):
        yield


def engines_on_cpu(what: str):
    """A skip mark for tests of what a node does only where its pool is on the CPU (``what``): the engines a test
    builds place the pool on jax's first device, the chip on a TPU host."""
    import jax
    import pytest

    backend = jax.default_backend()
    return pytest.mark.skipif(backend != "cpu", reason=f"{what} only where the pool is on the CPU; the engines' pool "
                                                       f"is on the {backend} here")
