"""DCP's plan caching (DefaultSavePlanner(enable_plan_caching=True)) through TieredWriter: the
second save of the same layout does not re-plan, yet claims its name, gets its own save id and
commits what it was given (real gloo ranks)."""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tiered_ckpt.io import commit

pytestmark = [pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="torch not installed"),
              pytest.mark.timeout(240)]

RANK = r"""
import json, os, sys
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from tiered_ckpt.dcp import TieredReader, TieredWriter
root, store, rank, world = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)

class Counting(DefaultSavePlanner):
    global_plans = 0
    def _create_global_plan(self, all_plans):
        Counting.global_plans += 1
        return super()._create_global_plan(all_plans)

def state(seed):
    g = torch.Generator().manual_seed(seed)
    return {"model": {"w": torch.randn(300, 7, generator=g), "b": torch.arange(9, dtype=torch.int32) * seed,
                      f"r{rank}": torch.full((5,), float(rank + seed))},   # one entry per rank: not deduplicated
            "step": seed}

out = {"plans": []}
for step in (1, 2, 3):
    w = TieredWriter(root, "m", epoch=0, step=step)
    dcp.save(state(step), storage_writer=w, planner=Counting(enable_plan_caching=True))
    out["plans"].append(Counting.global_plans)
ok = True
for step in (1, 2, 3):
    want = state(step)
    got = {"model": {k: torch.zeros_like(v) for k, v in want["model"].items()}, "step": 0}
    dcp.load(got, storage_reader=TieredReader(root, "m", epoch=0, step=step, verify_hash=True))
    ok = ok and got["step"] == step and all(torch.equal(got["model"][k], v) for k, v in want["model"].items())
out["ok"] = bool(ok)
print(json.dumps(out), flush=True)
dist.barrier()
os._exit(0)
"""


@pytest.mark.parametrize("world", [2])
def test_cached_plan_saves_without_replanning_under_their_own_save_ids(root: Path, tmp_path: Path, world: int) -> None:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    store = tmp_path / "store"
    ps = [subprocess.Popen([sys.executable, "-c", RANK, str(root), str(store), str(r), str(world)],
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env) for r in range(world)]
    outs = []
    for p in ps:
        out, err = p.communicate(timeout=200)
        assert p.returncode == 0, err[-4000:]
        outs.append(json.loads(out.strip().splitlines()[-1]))
    assert all(o["ok"] for o in outs), outs
    # The coordinator planned once: the second and third saves reused the cached global plan.
    assert outs[0]["plans"] == [1, 1, 1], outs
    infos = [c for c in commit.scan(root, "m")]
    assert [c.name for c in infos] == [f"global_epoch0_step{s}" for s in (1, 2, 3)] and all(c.committed for c in infos)
    markers = [commit.read_marker(c.path) for c in infos]
    sids = [m.save_id for m in markers if m is not None]
    assert len(set(sids)) == 3, sids          # each save committed under its own id
    names = [{f.path for f in m.files} for m in markers if m is not None]
    assert not (names[0] & names[1]) and not (names[1] & names[2]), names   # no file name of an earlier save reused
    for m, files in zip(markers, names, strict=True):
        assert m is not None and f"dcp.{m.save_id}.metadata" in files
        assert sum(1 for f in files if f.startswith("shard-")) == world
