"""Failing ranks fail every rank, quickly, with the failing rank's message: real torch.distributed
(gloo) processes and real file-mode (env-var ranks) processes."""
from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

from tiered_ckpt.io import commit
from tiered_ckpt.io.marker import MARKER

TORCH_RANK = r"""
import json, os, sys, time
import torch
import torch.distributed as dist
import tiered_ckpt as tc
from tiered_ckpt.io import lock
from tiered_ckpt.io import writer
from tiered_ckpt.config import IoConfig, NodeConfig
from tiered_ckpt.io.options import IoOptions
root, store, rank, T = sys.argv[1], sys.argv[2], int(sys.argv[3]), float(sys.argv[4])
dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
cfg = NodeConfig(root=root, model="m", io=IoConfig(threads=2, files_per_rank=2, block_size=64 << 10,
                                                   staging_bytes=1 << 20, sync_buffer_bytes=1 << 20))
out = {}

class Boom:                      # a stream source whose copy fails with a non-toolkit error
    nbytes = 1 << 20
    def copy_into(self, offset, view):
        raise RuntimeError("boom-copy")

def boom(what):
    def f(*a, **k):
        raise RuntimeError(what)
    return f

def attempt(case, step, state=None, patch=None):
    undo = None
    if patch is not None and rank == 0:
        obj, attr, fn = patch
        undo = (obj, attr, getattr(obj, attr))
        setattr(obj, attr, fn)
    t0 = time.monotonic()
    try:
        tc.save(state or {"t": torch.full((40_000,), rank + step, dtype=torch.int32)}, epoch=0, step=step,
                config=cfg, options=IoOptions(barrier_timeout=T))
        r = {"ok": True}
    except Exception as e:
        r = {"ok": False, "cls": type(e).__name__, "error": str(e)}
    finally:
        if undo is not None:
            setattr(*undo)
    r["seconds"] = time.monotonic() - t0
    out[case] = r

attempt("prepare", 1, patch=(writer.commit, "require_root", boom("boom-prepare")))
attempt("produce", 2, state={"s": Boom()} if rank == 0 else None)
attempt("commit", 3, patch=(writer.commit, "write_marker", boom("boom-commit")))
attempt("after", 3)                       # the claim was released, the failed attempt's files go
if rank == 0:                             # another saver holds the name: the whole job loses
    with lock.checkpoint_lock(root, "m", "global_epoch0_step4", "someone else"):
        attempt("conflict", 4)
else:
    attempt("conflict", 4)
if rank == 0:
    time.sleep(T + 2)                     # alive, but never takes part in this save
else:
    attempt("absent", 5)
print(json.dumps(out), flush=True)
os._exit(0)
"""


@pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="torch not installed")
def test_any_exception_on_rank_0_fails_rank_1_within_the_barrier_timeout(root: Path, tmp_path: Path) -> None:
    T = 5.0
    ps = [subprocess.Popen([sys.executable, "-c", TORCH_RANK, str(root), str(tmp_path / "store"), str(r), str(T)],
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in range(2)]
    outs = []
    try:
        for p in ps:
            o, e = p.communicate(timeout=150)
            assert p.returncode == 0 and o.strip(), e[-3000:]
            outs.append(json.loads(o.strip().splitlines()[-1]))
    finally:
        for p in ps:
            p.kill()
    r0, r1 = outs
    for case, what, stage in (("prepare", "boom-prepare", "preparing"), ("produce", "boom-copy", "writing"),
                              ("commit", "boom-commit", "committing")):
        assert not r0[case]["ok"] and what in r0[case]["error"], (case, r0[case])
        assert not r1[case]["ok"], (case, r1[case])
        assert f"rank 0 failed while {stage}" in r1[case]["error"] and what in r1[case]["error"], (case, r1[case])
        assert "nothing was committed" in r1[case]["error"]
        assert r1[case]["seconds"] < T, (case, r1[case])
    for step in (1, 2):
        assert commit.read_marker(root / "m" / f"global_epoch0_step{step}") is None
    assert r0["after"]["ok"] and r1["after"]["ok"], (r0["after"], r1["after"])
    m = commit.read_marker(root / "m" / "global_epoch0_step3")
    assert m is not None and m.save_id and all(m.save_id in f.path for f in m.files)
    on_disk = {p.name for p in (root / "m" / "global_epoch0_step3").iterdir()}
    assert on_disk == {f.path for f in m.files} | {MARKER}, "the failed attempt's files are gone"
    # the losing job: every rank gets ConflictError, nothing of it is on disk
    assert r0["conflict"]["cls"] == r1["conflict"]["cls"] == "ConflictError", (r0["conflict"], r1["conflict"])
    assert not (root / "m" / "global_epoch0_step4").exists() or not any((root / "m" / "global_epoch0_step4").iterdir())
    # a rank that never arrives: the other fails after the barrier timeout, not gloo's 30 minutes
    assert not r1["absent"]["ok"] and "not every rank took part" in r1["absent"]["error"], r1["absent"]
    assert r1["absent"]["seconds"] < T + 5, r1["absent"]
    assert commit.read_marker(root / "m" / "global_epoch0_step5") is None


FILE_RANK = r"""
import json, sys, time
import tiered_ckpt as tc
from tiered_ckpt.io import writer
from tiered_ckpt.config import IoConfig, NodeConfig
from tiered_ckpt.io.options import IoOptions
from tiered_ckpt.errors import UserError
root, rank, sid, fail_at = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
cfg = NodeConfig(root=root, model="m", io=IoConfig(threads=2, files_per_rank=2, block_size=64 << 10))

def boom(*a, **k):
    raise RuntimeError("boom-" + fail_at)

if rank == 1 and fail_at == "prepare":
    writer.commit.require_root = boom
if rank == 1 and fail_at == "write":
    writer.Save._write_part = boom
if rank == 1 and fail_at == "state":
    writer.Save.__init__ = boom
t0 = time.monotonic()
try:
    tc.save({"w": bytes([rank + 1]) * 200_000}, epoch=0, step=1, config=cfg, rank=rank, world_size=2,
            save_id=sid, options=IoOptions(barrier_timeout=20))
    out = {"ok": True}
except UserError as e:
    out = {"ok": False, "cls": type(e).__name__, "error": str(e), "code": e.exit_code}
out["seconds"] = time.monotonic() - t0
print(json.dumps(out))
"""


@pytest.mark.parametrize("fail_at", ["prepare", "write", "state"])
def test_file_mode_any_exception_on_one_rank_stops_the_others_at_once(root: Path, fail_at: str) -> None:
    ps = [subprocess.Popen([sys.executable, "-c", FILE_RANK, str(root), str(r), f"job-{fail_at}", fail_at],
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in range(2)]
    outs = []
    for p in ps:
        o, e = p.communicate(timeout=90)
        assert o.strip(), e[-3000:]
        outs.append(json.loads(o.strip().splitlines()[-1]))
    r0, r1 = outs
    assert not r1["ok"] and f"boom-{fail_at}" in r1["error"], r1
    assert not r0["ok"] and "rank 1 failed" in r0["error"] and f"boom-{fail_at}" in r0["error"], r0
    assert r0["seconds"] < 15, "rank 0 learns of it from the failure note, not from the barrier timeout"
    d = root / "m" / "global_epoch0_step1"
    assert commit.read_marker(d) is None
    assert not [p.name for p in d.iterdir() if p.name.startswith("shard-")], "each rank removed its own files"
