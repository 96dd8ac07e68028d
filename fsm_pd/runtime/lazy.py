"""Names a package exports without loading their modules until first use (PEP 562).

``kernels``, ``transport`` and ``control`` export names whose modules load jax or zmq; a jax-free or zmq-free module
of those packages (the layout, the messages, the effect handlers: what the simulation imports) must stay importable
without them, so the package's ``__init__`` names each export's module instead of importing it.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Mapping
from typing import Any


def lazy_exports(package: str, home: Mapping[str, str]) -> tuple[list[str], Callable[[str], Any]]:
    """``__all__`` and the module-level ``__getattr__`` for ``package``; ``home`` maps each exported name to the
    module that defines it, relative to the package."""

    def __getattr__(name: str) -> Any:
        if name not in home:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(f"{package}.{home[name]}"), name)
        setattr(sys.modules[package], name, value)  # the next lookup finds it without this hook
        return value

    return sorted(home), __getattr__
