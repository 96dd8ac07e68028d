"""bench/smaps.py (the soak's smaps diff) and the soak's shape sweep: what they report is what the numbers say."""

from __future__ import annotations

import mmap
import os
import sys
from pathlib import Path

# appended, not put first: a bench module must never shadow an installed package for the rest of the run (a
# bench/kernels.py once hid the `kernels` package from transformers in every later test)
sys.path.append(str(Path(__file__).resolve().parents[2] / "bench"))
import smaps  # noqa: E402
import soak  # noqa: E402

from fsm_pd.model.tiny import tiny_model_parts  # noqa: E402


def mapping(start: int, end: int, perms: str, path: str, rss: int, anon: int) -> str:
    return (f"{start:x}-{end:x} {perms} 00000000 00:00 0          {path}\n"
            f"Size:           {(end - start) >> 10} kB\nRss:            {rss} kB\nAnonymous:      {anon} kB\n"
            "VmFlags: rd wr mr mw me ac\n")


ARENA = 0x7F0000000000  # 64 MiB-aligned
MB = 1 << 20


def snapshot(arena_used: int, extra: bool, threads: list[str]) -> str:
    text = mapping(0x555500000000, 0x555500000000 + 4 * MB, "rw-p", "[heap]", 4096, 4096)
    text += mapping(ARENA, ARENA + arena_used, "rw-p", "", arena_used >> 10, arena_used >> 10)
    text += mapping(ARENA + arena_used, ARENA + 64 * MB, "---p", "", 0, 0)
    text += mapping(0x7F1000000000, 0x7F1000001000, "r-xp", "/usr/lib/libc.so.6", 4, 0)
    if extra:
        text += mapping(0x7F2000000000, 0x7F2000000000 + 8 * MB, "rw-p", "", 3000, 3000)
    return text + smaps.THREADS_MARK + "\n" + "".join(f"{100 + i} {name}\n" for i, name in enumerate(threads)) + "\n"


def test_diff_names_the_arena_that_grew_the_new_mapping_and_the_new_thread():
    old = smaps.parse(snapshot(2 * MB, False, ["python"]))
    new = smaps.parse(snapshot(5 * MB, True, ["python", "worker"]))
    assert smaps.kind(old.mappings[ARENA], old) == "arena"
    assert smaps.kind(new.mappings[0x7F2000000000], new) == "[anon]"
    assert new.rss_kb() - old.rss_kb() == 3072 + 3000
    report = smaps.diff(old, new)
    assert "+6072 kB" in report.splitlines()[0]
    assert "   +3072 kB rss     +3072 kB anon   +0  arena" in report
    assert "size 2048->5120 kB" in report
    assert "new mappings: 1, 3000 kB rss, 8192 kB size" in report
    assert "threads started: ['worker']; ended: []" in report


def test_a_live_snapshot_of_this_process_sees_a_fresh_buffer(tmp_path):
    before = tmp_path / "t-0.smaps.gz"
    after = tmp_path / "t-1.smaps.gz"
    smaps.save(os.getpid(), before)
    # a mapping of its own, every page written: malloc (numpy) may hand back memory the process already holds
    buffer = mmap.mmap(-1, 64 * MB)
    buffer.write(b"\1" * (64 * MB))
    smaps.save(os.getpid(), after)
    grown = smaps.load(after).rss_kb() - smaps.load(before).rss_kb()
    buffer.close()
    assert grown >= 60 * 1024, grown
    assert [n for n, _ in smaps.snapshots(tmp_path, "t")] == [0, 1]


def test_every_sweep_level_runs_a_phase_of_prompts_that_fit_one_decode_page():
    """A decode batch of only short prompts (page-table width 1) is its own program: the sweep must bring it about
    at every batch level, not leave it to chance during the soak."""
    tokenizer = tiny_model_parts()[2]
    page_size, new_tokens = 16, 4
    levels_short, levels_long = set(), set()
    for _, level, indices in soak.shape_sweep(16):
        lengths = [len(tokenizer.encode(body.get("text") or body.get("prompt")))
                   for _, body in map(soak.request_for, indices)]
        if max(lengths) + new_tokens <= page_size:
            levels_short.add(level)
        if min(lengths) > page_size:
            levels_long.add(level)
    assert levels_short == levels_long == {1, 2, 4, 8, 16}
