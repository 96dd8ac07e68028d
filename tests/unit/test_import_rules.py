"""The package import rules of ``docs/architecture.md``, checked against the code.

The table in the doc is the source: for each ``fsm_pd/<package>``, ``fsm_pd/<package>/<module>.py`` (a module held to
a narrower rule than its package) or ``fsm_pd/<module>.py`` row, the fsm-pd packages and top-level modules it may
import (third column; a module's own package is always allowed) and the modules it never imports (fourth column).
Imports are read with ``ast`` from every module of the package, function-level ones included, ``if TYPE_CHECKING:``
blocks excepted, and imports by name too: the argument of ``import_module`` / ``__import__`` / ``find_spec``, and the
strings of a dict literal that name an fsm-pd module (lazy-export tables, the backend registry). Packages that never
import one of the heavy libraries also have every one of their modules imported in a fresh interpreter, which proves
they do not load it through another package.
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "fsm_pd"
HEAVY = ("jax", "zmq", "sqlalchemy", "fastapi")


def rules() -> dict[str, tuple[set[str], set[str]]]:
    """{package, ``package/module`` or top-level module: (fsm-pd packages and modules it may import, modules it never
    imports)} from the architecture table."""
    found = {}
    for line in (ROOT / "docs" / "architecture.md").read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) != 4 or not re.fullmatch(r"`fsm_pd/\w+(/\w+\.py|\.py)?`", cells[0]):
            continue
        name = cells[0].strip("`").split("/", 1)[1].removesuffix(".py")
        found[name] = (set(re.findall(r"`(\w+)`", cells[2])), set(re.findall(r"`([\w.]+)`", cells[3])))
    return found


RULES = rules()


STRING_IMPORTERS = {"import_module", "__import__", "find_spec"}


def names_a_module(text: str) -> bool:
    """``text`` is ``fsm_pd.a.b`` (or ``fsm_pd.a.b:attr``) and that module exists."""
    dotted = text.split(":", 1)[0]
    if not re.fullmatch(r"fsm_pd(\.\w+)+", dotted):
        return False
    path = ROOT.joinpath(*dotted.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def imports(path: Path) -> list[tuple[int, str]]:
    """(line, dotted module) of every absolute import in ``path``, outside ``if TYPE_CHECKING:``, by name included."""
    tree = ast.parse(path.read_text(), str(path))
    skipped = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If) and _type_checking(node.test)
               for stmt in node.body for n in ast.walk(stmt)}
    found = []
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.append((node.lineno, node.module))
        elif (isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant)
              and isinstance(node.args[0].value, str)
              and getattr(node.func, "attr", getattr(node.func, "id", None)) in STRING_IMPORTERS):
            found.append((node.lineno, node.args[0].value))
        elif isinstance(node, ast.Dict):
            found += [(c.lineno, c.value.split(":", 1)[0]) for c in [*node.keys, *node.values]
                      if isinstance(c, ast.Constant) and isinstance(c.value, str) and names_a_module(c.value)]
    return found


def _type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def sources(name: str) -> list[Path]:
    """The files of a package, or the one file of a module (top-level, or ``package/module``)."""
    module = PACKAGE / f"{name}.py"
    return [module] if module.is_file() else sorted((PACKAGE / name).rglob("*.py"))


def violations(name: str) -> list[str]:
    allowed, never = RULES[name]
    package = name.split("/")[0]
    found = []
    for path in sources(name):
        where = path.relative_to(ROOT)
        for line, module in imports(path):
            parts = module.split(".")
            if parts[0] == "fsm_pd" and len(parts) > 1 and parts[1] != package and parts[1] not in allowed:
                found.append(f"{where}:{line} imports {module}: {name} may import only {sorted(allowed)}")
            elif parts[0] in never:
                found.append(f"{where}:{line} imports {module}: {name} never imports {parts[0]}")
    return found


def test_the_table_names_every_package_and_top_level_module():
    packages = {p.name for p in PACKAGE.iterdir() if (p / "__init__.py").exists()}
    modules = {p.stem for p in PACKAGE.glob("*.py") if p.stem != "__init__"}
    missing = (packages | modules) - set(RULES)
    assert not missing, f"add these to the table in docs/architecture.md: {sorted(missing)}"
    narrowed = [name for name in RULES if "/" in name]
    assert all(sources(name) and sources(name)[0].is_file() for name in narrowed), narrowed
    assert RULES["machines"] == (set(), RULES["machines"][1]) and {"jax", "time"} <= RULES["machines"][1]
    assert "jax" in RULES["sim"][1]
    assert RULES["kvpool"] == (set(), RULES["kvpool"][1]) and "jax" in RULES["kvpool"][1]  # bookkeeping, no model


@pytest.mark.parametrize("package", sorted(RULES))
def test_package_imports_follow_the_table(package):
    assert violations(package) == []


LOADS_NO_HEAVY = sorted(p for p, (_, never) in RULES.items() if set(HEAVY) & never)


def module_names(package: str) -> list[str]:
    """Every module of a package (its ``__init__`` and each file below it, but a ``__main__``, which runs when
    imported), or the one top-level module."""
    return [".".join(("fsm_pd", *path.relative_to(PACKAGE).with_suffix("").parts)).removesuffix(".__init__")
            for path in sources(package) if path.stem != "__main__"]


@pytest.mark.parametrize("package", LOADS_NO_HEAVY)
def test_package_loads_none_of_its_forbidden_libraries(package):
    """Every module of the package, not only its ``__init__``: a package whose ``__init__`` is empty or lazy would
    pass whatever its modules import."""
    forbidden = sorted(set(HEAVY) & RULES[package][1])
    code = (f"import importlib, sys\nfor name in {module_names(package)!r}:\n    importlib.import_module(name)\n"
            f"print(sorted(m for m in {forbidden!r} if m in sys.modules or any(k.startswith(m + '.') "
            "for k in sys.modules)))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]", f"importing fsm_pd.{package} loads {out.stdout.strip()}"
