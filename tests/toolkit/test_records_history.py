"""The event history the timeline draws from: concurrent writers, crashes mid-line, planted files."""
from __future__ import annotations

import multiprocessing
import os
import stat
import subprocess
import sys
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


SAVE_SCRIPT = r"""
import os, sys
import numpy as np
import tiered_ckpt as tc
from tiered_ckpt import records
root = sys.argv[1]
d = records.records_dir(root, "m")
d.mkdir(parents=True, exist_ok=True)
# A FIFO at the temporary name this very process would write its record to.
import threading
os.mkfifo(d / f".save.json.{os.getpid()}.{threading.get_ident()}.tmp")
os.mkfifo(d / f".save.{os.getpid()}.tmp")
tc.save({"w": np.arange(8, dtype=np.float32)}, root=root, model="m", epoch=0, step=int(sys.argv[2]))
print("saved", flush=True)
"""


def _save_in_process(root: Path, step: int) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    return subprocess.run([sys.executable, "-c", SAVE_SCRIPT, str(root), str(step)], capture_output=True,
                          text=True, timeout=60, env=env)


def test_fifos_in_the_records_directory_never_hang_a_save_after_its_commit(tmp_path: Path) -> None:
    """FIFOs at the record's temporary name, the locks, and history.jsonl held open by a reader:
    tc.save (a real process) returns, its record and history line are written, and the next
    writer does not block on the history lock either."""
    root = tmp_path / "lustre"
    root.mkdir()
    d = records.records_dir(root, "m")
    d.mkdir(parents=True)
    for name in (".save.lock", ".history.lock", records.HISTORY):
        os.mkfifo(d / name)
    held = os.open(d / records.HISTORY, os.O_RDONLY | os.O_NONBLOCK)     # a reader holds it open
    try:
        r = _save_in_process(root, 1)
        assert r.returncode == 0 and "saved" in r.stdout, r.stderr[-3000:]
        r = _save_in_process(root, 2)
        assert r.returncode == 0 and "saved" in r.stdout, r.stderr[-3000:]
    finally:
        os.close(held)
    assert (records.read(root, "m", records.SAVE) or {}).get("name") == "global_epoch0_step2"
    assert [h.get("name") for h in records.history(root, "m")] == ["global_epoch0_step1", "global_epoch0_step2"]
    for name in (".save.lock", ".history.lock", records.HISTORY, "save.json"):
        assert stat.S_ISREG(os.lstat(d / name).st_mode), name


def test_a_stopped_writer_holding_the_history_lock_costs_one_line_not_the_operation(tmp_path: Path) -> None:
    root = tmp_path / "lustre"
    root.mkdir()
    records.record(root, "m", records.SAVE, {"checkpoint": "a"})
    d = records.records_dir(root, "m")
    holder = subprocess.Popen([sys.executable, "-c", "import fcntl, os, sys, time\n"
                               "fd = os.open(sys.argv[1], os.O_RDWR); fcntl.flock(fd, fcntl.LOCK_EX)\n"
                               "print('held', flush=True); time.sleep(120)", str(d / ".history.lock")],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        r = _save_in_process(root, 3)
        assert r.returncode == 0 and "saved" in r.stdout, r.stderr[-3000:]
        assert "could not record" in r.stderr
    finally:
        holder.kill()
        holder.wait()
    # The last record was still replaced; only the history line was skipped.
    assert (records.read(root, "m", records.SAVE) or {}).get("name") == "global_epoch0_step3"
