"""torch.distributed (gloo, CPU) ranks: each writes its own files, all agree, rank 0 commits.
Skipped where torch is not installed (it is optional for the toolkit)."""
from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

from tiered_ckpt.io import commit
from tiered_ckpt.io.reader import verify

pytestmark = pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="torch not installed")

RANK = r"""
import json, sys
from datetime import timedelta
import torch
import torch.distributed as dist
import tiered_ckpt as tc
from tiered_ckpt.config import IoConfig, NodeConfig
from tiered_ckpt.errors import UserError
root, store, rank, bad = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4] == "1"
# A short timeout: a failing rank's partner fails within a minute, not after gloo's default 30.
dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2, timeout=timedelta(seconds=60))
cfg = NodeConfig(root=root, model="m", io=IoConfig(threads=2, files_per_rank=2, block_size=64 << 10, staging_bytes=1 << 20))
out = {}
try:
    state = {"t": torch.full((50_000,), rank, dtype=torch.bfloat16), "step": torch.tensor(7)}
    if bad and rank == 1:
        state["oops"] = {"not a tensor"}    # a set: neither a buffer nor a JSON scalar (a str now is one)
    tc.save(state, epoch=0, step=1, config=cfg)
    h = tc.async_save({"t": torch.arange(30_000) * (rank + 1)}, epoch=0, step=2, config=cfg)
    h.wait(60)
    got = tc.load("global_epoch0_step1", config=cfg, verify_hash=True)
    out = {"ok": bool(torch.equal(got["t"], state["t"])) and got["t"].dtype == torch.bfloat16,
           "async_ok": bool(torch.equal(tc.load(config=cfg)["t"], torch.arange(30_000) * (rank + 1)))}
except UserError as e:
    out = {"ok": False, "error": str(e)}
dist.destroy_process_group()
print(json.dumps(out))
"""


def _run(root: Path, tmp: Path, bad: bool) -> list[dict[str, object]]:
    store = tmp / ("store-bad" if bad else "store")
    ps = [subprocess.Popen([sys.executable, "-c", RANK, str(root), str(store), str(r), "1" if bad else "0"],
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in range(2)]
    outs = []
    for p in ps:
        out, err = p.communicate(timeout=120)
        assert p.returncode == 0, err[-3000:]
        outs.append(json.loads(out.strip().splitlines()[-1]))
    return outs


def test_two_torch_ranks_save_async_save_and_load(root: Path, tmp_path: Path) -> None:
    outs = _run(root, tmp_path, bad=False)
    assert all(o["ok"] and o["async_ok"] for o in outs), outs
    m = commit.read_marker(root / "m" / "global_epoch0_step1")
    assert m is not None and m.world_size == 2 and {f.rank for f in m.files} == {0, 1}
    assert verify(root / "m" / "global_epoch0_step1", check_hash=True).ok


def test_one_rank_failing_fails_every_rank_without_hanging(root: Path, tmp_path: Path) -> None:
    outs = _run(root, tmp_path, bad=True)
    assert "'oops' (set) is not a buffer" in str(outs[1]["error"])
    assert "rank 1 failed" in str(outs[0]["error"]) and "nothing was committed" in str(outs[0]["error"])
    assert commit.read_marker(root / "m" / "global_epoch0_step1") is None
