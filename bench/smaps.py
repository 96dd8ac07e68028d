"""Where did a process's RSS go? Snapshots of /proc/PID/smaps and a diff of two of them by mapping.

`bench/soak.py --smaps DIR` saves a snapshot of every child at the end of the warm-up and at every sample
(``<name>-<requests>.smaps.gz``: the raw smaps, then a trailer of the process's threads). Diff two of them:

    python bench/smaps.py DIR/decode-0-0.smaps.gz DIR/decode-0-20000.smaps.gz [--top 15]
    python bench/smaps.py --steps DIR decode-0       # the diff around each step of the sampled RSS (>= --step-kb)

A mapping is known by its start address: the main heap ([heap]) and a thread's malloc arena (an anonymous region
aligned to 64 MiB, grown inside its reservation) keep their start as they grow; a new mmap gets a new one. Each
mapping is put in a kind: [heap], arena (64 MiB-aligned anonymous, with its reserved ``---p`` rest), [stack],
[anon] (any other anonymous mapping), or file (its path). The diff prints the RSS and anonymous growth per kind,
then the mappings that grew most, the new ones and the gone ones, and the threads started and ended in between.
"""

from __future__ import annotations

import argparse
import contextlib
import gzip
import re
import sys
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

ARENA_ALIGN = 64 << 20  # glibc's HEAP_MAX_SIZE on 64-bit: a thread arena's reservation is aligned to it
HEADER = re.compile(r"^([0-9a-f]+)-([0-9a-f]+) (\S{4}) \S+ \S+ \S+\s*(.*)$")
THREADS_MARK = "# threads"


@dataclass
class Mapping:
    start: int
    end: int
    perms: str
    path: str
    fields: dict[str, int] = field(default_factory=dict)

    @property
    def size_kb(self) -> int:
        return (self.end - self.start) >> 10

    def kb(self, name: str) -> int:
        return self.fields.get(name, 0)


@dataclass
class Snapshot:
    mappings: dict[int, Mapping]
    threads: dict[int, str]  # tid -> name

    def rss_kb(self) -> int:
        return sum(m.kb("Rss") for m in self.mappings.values())


def snapshot_text(pid: int) -> str:
    """The raw smaps of ``pid`` and a trailer naming its threads (a thread started lazily shows up as a new stack)."""
    with open(f"/proc/{pid}/smaps") as f:
        text = f.read()
    lines = [THREADS_MARK]
    for task in sorted(Path(f"/proc/{pid}/task").iterdir(), key=lambda p: int(p.name)):
        with contextlib.suppress(OSError):  # the thread ended while we read
            lines.append(f"{task.name} {(task / 'comm').read_text().strip()}")
    return text + "\n".join(lines) + "\n"


def save(pid: int, path: Path) -> None:
    path.write_bytes(gzip.compress(snapshot_text(pid).encode(), compresslevel=3))


def parse(text: str) -> Snapshot:
    mappings: dict[int, Mapping] = {}
    threads: dict[int, str] = {}
    current = None
    in_threads = False
    for line in text.splitlines():
        if line == THREADS_MARK:
            in_threads = True
            continue
        if in_threads:
            tid, _, name = line.partition(" ")
            if tid.isdigit():
                threads[int(tid)] = name
            continue
        header = HEADER.match(line)
        if header:
            start, end, perms, path = header.groups()
            current = Mapping(int(start, 16), int(end, 16), perms, path.strip())
            mappings[current.start] = current
        elif current is not None and line.endswith(" kB"):
            name, value = line.split(":", 1)
            current.fields[name] = int(value.split()[0])
    return Snapshot(mappings, threads)


def load(path: Path) -> Snapshot:
    data = path.read_bytes()
    return parse((gzip.decompress(data) if path.suffix == ".gz" else data).decode())


def kind(m: Mapping, snap: Snapshot) -> str:
    if m.path:
        return m.path if not m.path.startswith("[stack") else "[stack]"
    if m.start % ARENA_ALIGN == 0:
        following = snap.mappings.get(m.end)
        if following is not None and following.perms.startswith("---") and not following.path \
                and following.end - m.start == ARENA_ALIGN:
            return "arena"
        if m.end - m.start == ARENA_ALIGN and m.perms.startswith("rw"):
            return "arena"
    return "[anon]"


def by_kind(snap: Snapshot) -> dict[str, list[int]]:
    totals: dict[str, list[int]] = defaultdict(lambda: [0, 0, 0])
    for m in snap.mappings.values():
        t = totals[kind(m, snap)]
        t[0] += m.kb("Rss")
        t[1] += m.kb("Anonymous")
        t[2] += 1
    return totals


def describe(m: Mapping, snap: Snapshot) -> str:
    return f"{m.start:012x}-{m.end:012x} {m.perms} {m.size_kb:>9} kB  {kind(m, snap)}"


def diff(old: Snapshot, new: Snapshot, top: int = 15) -> str:
    out = [f"RSS {old.rss_kb()} -> {new.rss_kb()} kB ({new.rss_kb() - old.rss_kb():+d} kB); "
           f"mappings {len(old.mappings)} -> {len(new.mappings)}; threads {len(old.threads)} -> {len(new.threads)}"]
    a, b = by_kind(old), by_kind(new)
    rows = []
    for k in set(a) | set(b):
        (ra, aa, na), (rb, ab, nb) = a.get(k, [0, 0, 0]), b.get(k, [0, 0, 0])
        if ra != rb or aa != ab or na != nb:
            rows.append((rb - ra, ab - aa, nb - na, k))
    out.append("by kind (Rss / Anonymous growth, mappings):")
    for d_rss, d_anon, d_n, k in sorted(rows, key=lambda r: -abs(r[0]))[:top]:
        out.append(f"  {d_rss:+9d} kB rss {d_anon:+9d} kB anon {d_n:+4d}  {k}")
    grew = []
    for start, m in new.mappings.items():
        was = old.mappings.get(start)
        if was is not None and (m.kb("Rss") != was.kb("Rss") or m.end != was.end):
            grew.append((m.kb("Rss") - was.kb("Rss"), m.kb("Anonymous") - was.kb("Anonymous"), m, was))
    out.append("mappings that changed most (same start):")
    for d_rss, d_anon, m, was in sorted(grew, key=lambda r: -abs(r[0]))[:top]:
        size = f" size {was.size_kb}->{m.size_kb} kB" if m.end != was.end else ""
        out.append(f"  {d_rss:+9d} kB rss {d_anon:+9d} kB anon  {describe(m, new)}{size}")
    for title, left, right, snap in (("new", new, old, new), ("gone", old, new, old)):
        # A reservation (---p: an arena's rest, a guard page) holds no memory and moves as its arena grows.
        only = [m for s, m in left.mappings.items() if s not in right.mappings and not m.perms.startswith("---")]
        out.append(f"{title} mappings: {len(only)}, {sum(m.kb('Rss') for m in only)} kB rss, "
                   f"{sum(m.size_kb for m in only)} kB size")
        for m in sorted(only, key=lambda m: -m.kb("Rss"))[:top]:
            out.append(f"  {m.kb('Rss'):9d} kB rss {m.kb('Anonymous'):9d} kB anon  {describe(m, snap)}")
    started = {t: n for t, n in new.threads.items() if t not in old.threads}
    ended = {t: n for t, n in old.threads.items() if t not in new.threads}
    out.append(f"threads started: {sorted(started.values())}; ended: {sorted(ended.values())}")
    return "\n".join(out)


def snapshots(directory: Path, name: str) -> list[tuple[int, Path]]:
    """``name``'s snapshots in ``directory``, by requests after warm-up."""
    found = []
    for path in directory.glob(f"{name}-*.smaps.gz"):
        tail = path.name[len(name) + 1:-len(".smaps.gz")]
        if tail.isdigit():
            found.append((int(tail), path))
    return sorted(found)


def steps(directory: Path, name: str, step_kb: int, top: int) -> str:
    """The diff between consecutive snapshots wherever RSS moved by ``step_kb`` or more."""
    series = snapshots(directory, name)
    if len(series) < 2:
        return f"fewer than two snapshots of {name} in {directory}"
    out = []
    previous_n, previous = series[0][0], load(series[0][1])
    first = previous
    for n, path in series[1:]:
        current = load(path)
        if abs(current.rss_kb() - previous.rss_kb()) >= step_kb:
            out.append(f"=== {name}: {previous_n} -> {n} requests")
            out.append(diff(previous, current, top))
        previous_n, previous = n, current
    out.append(f"=== {name}: whole soak, {series[0][0]} -> {previous_n} requests")
    out.append(diff(first, previous, top))
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("paths", nargs="*", help="two snapshots (old, new)")
    parser.add_argument("--steps", nargs=2, metavar=("DIR", "NAME"),
                        help="diff around every step of NAME's snapshots in DIR (and over the whole soak)")
    parser.add_argument("--step-kb", type=int, default=512, help="what counts as a step (default 512 kB)")
    parser.add_argument("--top", type=int, default=15, help="rows per section (default 15)")
    args = parser.parse_args(argv)
    if args.steps:
        print(steps(Path(args.steps[0]), args.steps[1], args.step_kb, args.top))
        return 0
    if len(args.paths) != 2:
        parser.error("give two snapshots, or --steps DIR NAME")
    print(diff(load(Path(args.paths[0])), load(Path(args.paths[1])), args.top))
    return 0


if __name__ == "__main__":
    sys.exit(main())
