"""The event history the timeline draws from: concurrent writers, crashes mid-line, planted files."""
from __future__ import annotations

import multiprocessing
import os
from pathlib import Path

from tiered_ckpt import records

N_PROC, N_EACH = 4, 50


def _writer(root: str, who: int) -> None:
    for i in range(N_EACH):
        records.record(root, "m", records.SAVE, {"name": f"p{who}-{i}", "pad": "x" * 300})


def test_concurrent_processes_append_whole_lines_and_none_is_lost(tmp_path: Path) -> None:
    root = tmp_path / "lustre"
    root.mkdir()
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=_writer, args=(str(root), w)) for w in range(N_PROC)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
        assert p.exitcode == 0
    got = [h["name"] for h in records.history(root, "m") if h.get("kind") == records.SAVE]
    assert sorted(got) == sorted(f"p{w}-{i}" for w in range(N_PROC) for i in range(N_EACH))
    # Each process's own records stay in the order it wrote them.
    for w in range(N_PROC):
        mine = [g for g in got if g.startswith(f"p{w}-")]
        assert mine == [f"p{w}-{i}" for i in range(N_EACH)]


def test_a_line_cut_short_and_garbage_are_skipped(tmp_path: Path) -> None:
    root = tmp_path / "lustre"
    root.mkdir()
    records.record(root, "m", records.SAVE, {"name": "a"})
    hist = records.records_dir(root, "m") / records.HISTORY
    with open(hist, "ab") as f:
        f.write(b'["not a record"]\n{"time_unix": "soon"}\n\xff\xfe\n{"name": "cut", "time_un')   # a crash mid-write
    records.record(root, "m", records.SAVE, {"name": "b"})
    names = [h.get("name") for h in records.history(root, "m")]
    assert names == ["a", "b"]


def test_a_planted_symlink_or_fifo_is_neither_followed_nor_blocks(tmp_path: Path) -> None:
    root = tmp_path / "lustre"
    root.mkdir()
    d = records.records_dir(root, "m")
    d.mkdir(parents=True)
    secret = tmp_path / "elsewhere.jsonl"
    secret.write_text('{"name": "planted", "time_unix": 1}\n')
    (d / records.HISTORY).symlink_to(secret)
    os.mkfifo(d / records.HISTORY_OLD)
    assert records.history(root, "m") == []                  # not read through the link, FIFO not opened blocking
    records.record(root, "m", records.SAVE, {"name": "x"})   # the append refuses the link: a warning, no exception
    assert secret.read_text() == '{"name": "planted", "time_unix": 1}\n'
    assert (records.read(root, "m", records.SAVE) or {}).get("name") == "x"
