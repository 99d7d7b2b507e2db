"""dcp.async_save through TieredWriter and TieredStager, in thread and process mode, with real
gloo ranks: bit-exact loads, the state may change once async_save returned, the stager's pool
stays within its budget (a state larger than the budget still saves correctly); and a failed
save does not keep the checkpoint name claimed."""
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
              pytest.mark.timeout(300)]

RANK = r"""
import json, os, sys
from datetime import timedelta
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType
from tiered_ckpt.dcp import TieredReader, TieredWriter
from tiered_ckpt.dcp_stage import TieredStager
mode, root, store, rank, world = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5])
# A short timeout: a failing rank's partner fails within a minute, not after gloo's default 30.
dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world, timeout=timedelta(seconds=60))

def state(seed):
    g = torch.Generator().manual_seed(seed)
    st = {"model": {"w": torch.randn(256, 64, generator=g), "b": torch.arange(300, dtype=torch.int64) * seed,
                    "h": torch.randn(32, 8, generator=g).to(torch.bfloat16), f"r{rank}": torch.full((7,), rank + 0.5)},
          "step": seed, "tag": f"t{seed}"}
    if world > 1:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import Shard, distribute_tensor
        mesh = init_device_mesh("cpu", (world,))
        st["model"]["d"] = distribute_tensor(torch.arange(64 * 6, dtype=torch.float32).reshape(64, 6) * seed, mesh, [Shard(0)])
    return st

def loads_as(step, want):
    got = {"model": {k: torch.zeros_like(v) for k, v in want["model"].items()}, "step": 0, "tag": ""}
    dcp.load(got, storage_reader=TieredReader(root, "m", epoch=0, step=step, verify_hash=True))
    ok = got["step"] == want["step"] and got["tag"] == want["tag"]
    for k, v in want["model"].items():
        a, b = got["model"][k], v
        if hasattr(a, "full_tensor"):
            a, b = a.full_tensor(), b.full_tensor()
        ok = ok and bool(torch.equal(a, b))
    return ok

def spoil(st):
    with torch.no_grad():
        for v in st["model"].values():
            (v.to_local() if hasattr(v, "to_local") else v).add_(1)

out = {}
if mode in ("thread", "process", "budget"):
    kind = AsyncCheckpointerType.PROCESS if mode == "process" else AsyncCheckpointerType.THREAD
    budget = (64 << 10) if mode == "budget" else (64 << 20)
    stager = TieredStager(budget_bytes=budget, share_memory=mode == "process")
    ok = True
    for step in (1, 2):
        st = state(step)
        fut = dcp.async_save(st, storage_writer=TieredWriter(root, "m", epoch=0, step=step), async_stager=stager,
                             async_checkpointer_type=kind)
        spoil(st)                    # training goes on: the checkpoint must hold the state as it was
        fut.result()
        ok = ok and loads_as(step, state(step))
    out["ok"] = ok
    out["peak"], out["pool"], out["budget"] = stager.peak_bytes, stager.pool_bytes, stager.budget
    out["need"] = sum(-(-(x.to_local() if hasattr(x, "to_local") else x).nbytes // 4096) * 4096
                      for x in state(1)["model"].values())
    stager.close()
elif mode in ("fail-other", "fail-coordinator"):
    bad = 1 if mode == "fail-other" else 0
    class Failing(DefaultSavePlanner):
        def resolve_data(self, item):
            if dist.get_rank() == bad:
                raise RuntimeError("disk on fire")
            return super().resolve_data(item)
    try:
        dcp.save(state(1), storage_writer=TieredWriter(root, "m", epoch=0, step=1), planner=Failing())
        out["first"] = "saved"
    except BaseException as e:  # noqa: BLE001 - DCP raises CheckpointException, a BaseException
        out["first"] = type(e).__name__
    # A new writer object for the same name; the first one is never closed by hand.
    dcp.save(state(1), storage_writer=TieredWriter(root, "m", epoch=0, step=1))
    out["ok"] = loads_as(1, state(1))
print(json.dumps(out), flush=True)
dist.barrier()
os._exit(0)
"""


def _run(mode: str, root: Path, tmp: Path, world: int) -> list[dict[str, object]]:
    store = tmp / f"store-{mode}-{world}"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path), MASTER_ADDR="127.0.0.1")
    ps = [subprocess.Popen([sys.executable, "-c", RANK, mode, str(root), str(store), str(r), str(world)],
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env) for r in range(world)]
    outs = []
    for p in ps:
        out, err = p.communicate(timeout=280)
        assert p.returncode == 0, err[-4000:]
        outs.append(json.loads(out.strip().splitlines()[-1]))
    return outs


def _committed(root: Path) -> list[str]:
    return [c.name for c in commit.scan(root, "m") if c.committed]


@pytest.mark.parametrize("mode", ["thread", "process"])
@pytest.mark.parametrize("world", [1, 2])
def test_async_save_loads_bit_exact_though_the_state_changed_after_staging(root: Path, tmp_path: Path, mode: str,
                                                                           world: int) -> None:
    outs = _run(mode, root, tmp_path, world)
    assert all(o["ok"] for o in outs), outs
    assert _committed(root) == ["global_epoch0_step1", "global_epoch0_step2"]
    for o in outs:   # sized to the state, and reused by the second save (the first one's extent was freed)
        assert int(o["peak"]) == int(o["pool"]) == int(o["need"]), o


def test_a_state_larger_than_the_budget_saves_correctly_and_the_pool_stays_within_it(root: Path, tmp_path: Path) -> None:
    outs = _run("budget", root, tmp_path, 1)
    assert all(o["ok"] for o in outs), outs
    assert _committed(root) == ["global_epoch0_step1", "global_epoch0_step2"]
    for o in outs:   # the state is ~80 KiB of tensors; the pool never held more than 64 KiB
        assert 0 < int(o["peak"]) <= int(o["budget"]) == 64 << 10, o


@pytest.mark.parametrize(("mode", "world"), [("fail-coordinator", 1), ("fail-other", 2)])
def test_a_failed_save_releases_the_name_for_a_new_writer(root: Path, tmp_path: Path, mode: str, world: int) -> None:
    outs = _run(mode, root, tmp_path, world)
    assert all(o["first"] == "CheckpointException" and o["ok"] for o in outs), outs
    assert _committed(root) == ["global_epoch0_step1"]


def test_a_pickled_writer_carries_no_claim_and_no_descriptor(root: Path) -> None:
    """Process mode pickles the writer into DCP's background process, which claims the name itself."""
    import pickle

    from tiered_ckpt.dcp import TieredWriter
    from tiered_ckpt.errors import ConflictError

    w = TieredWriter(root, "m", epoch=0, step=9)
    w.set_up_storage_writer(True)
    w.prepare_global_plan([])                   # the coordinator's claim, and the directory open
    assert w._dfd is not None
    copy = pickle.loads(pickle.dumps(w))
    assert copy._hold is None and copy._dfd is None and copy.path == w.path
    with pytest.raises(ConflictError, match="cannot save global_epoch0_step9 now"):
        copy.prepare_global_plan([])            # the original still holds the name
    w.close()
    copy.prepare_global_plan([])                # released: the copy claims it now
    copy.close()
