"""save_training / load_training: model + AdamW + LR scheduler + extras through DCP, on real gloo ranks
(subprocesses): bit-exact resume (the next training step matches), latest-load, DDP, no process group."""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tiered_ckpt.io import commit

pytestmark = pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="torch not installed")

RANK = r"""
import json, os, sys
import torch
import torch.distributed as dist
from tiered_ckpt.config import NodeConfig
from tiered_ckpt.training import load_training, save_training
mode, root, ref, store, rank, world, wrap = (sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4], int(sys.argv[5]),
                                             int(sys.argv[6]), sys.argv[7])
if world > 1:
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
cfg = NodeConfig(root=root, model="m")

def make(seed):
    torch.manual_seed(seed)
    m = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 64))
    if wrap == "ddp":
        m = torch.nn.parallel.DistributedDataParallel(m)
    elif wrap == "fsdp":                        # FSDP2: every parameter a DTensor sharded over the ranks
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        mesh = init_device_mesh("cpu", (world,))
        for layer in m:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(m, mesh=mesh)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    return m, opt, sched

def train(m, opt, sched, n, seed):
    g = torch.Generator().manual_seed(seed)
    for _ in range(n):
        opt.zero_grad()
        m(torch.randn(8, 64, generator=g)).square().mean().backward()
        opt.step()
        sched.step()

def full(v):
    from torch.distributed.tensor import DTensor
    return (v.full_tensor() if isinstance(v, DTensor) else torch.as_tensor(v)).clone()   # collective for DTensors

def snap(m, opt, sched):
    inner = m.module if wrap == "ddp" else m
    o = opt.state_dict()
    return {"params": {k: full(v) for k, v in inner.state_dict().items()},
            "state": {k: {kk: full(vv) for kk, vv in s.items()} for k, s in o["state"].items()},
            "groups": o["param_groups"], "sched": sched.state_dict()}

def same(a, b):
    if a["params"].keys() != b["params"].keys() or a["state"].keys() != b["state"].keys():
        return False
    ok = all(torch.equal(v, b["params"][k]) and v.dtype == b["params"][k].dtype for k, v in a["params"].items())
    for k, s in a["state"].items():
        ok = ok and s.keys() == b["state"][k].keys() and all(torch.equal(v, b["state"][k][kk]) for kk, v in s.items())
    return bool(ok and a["groups"] == b["groups"] and a["sched"] == b["sched"])

out = {}
if mode in ("save", "roundtrip"):
    m, opt, sched = make(0)
    train(m, opt, sched, 3, seed=1)
    extra = {"rank": rank, "rng": torch.get_rng_state(), "seen": [3, rank]}
    r = save_training(m, opt, scheduler=sched, epoch=0, step=3, extra=extra, config=cfg)
    out["name"] = r.name
    before = snap(m, opt, sched)
    train(m, opt, sched, 1, seed=2)
    torch.save({"before": before, "after": snap(m, opt, sched), "rng": extra["rng"]}, f"{ref}-{rank}.pt")
if mode in ("load", "roundtrip"):
    want = torch.load(f"{ref}-0.pt", weights_only=False)    # rank 0's: every rank trained the same
    m, opt, sched = make(123)                               # other weights: a load that did nothing fails
    got = load_training(m, opt, scheduler=sched, config=cfg, verify_hash=True)   # no name: the newest
    out["loaded"] = [got.name, got.epoch, got.step]
    out["extra"] = {"rank": got.extra["rank"], "seen": got.extra["seen"],
                    "rng": bool(torch.equal(got.extra["rng"], torch.load(f"{ref}-{got.extra['rank']}.pt",
                                                                         weights_only=False)["rng"]))}
    out["restored"] = same(snap(m, opt, sched), want["before"])
    out["steps"] = sorted({float(s["step"]) for s in opt.state_dict()["state"].values()})
    train(m, opt, sched, 1, seed=2)
    out["resumed"] = same(snap(m, opt, sched), want["after"])
print(json.dumps(out), flush=True)
if world > 1:
    dist.barrier()
os._exit(0)   # gloo teardown at exit sometimes aborts; the ranks agreed above
"""


def _run(mode: str, root: Path, tmp: Path, world: int, wrap: str = "none") -> list[dict[str, Any]]:
    store = tmp / f"store-{mode}-{world}-{wrap}"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    ps = [subprocess.Popen([sys.executable, "-c", RANK, mode, str(root), str(tmp / "ref"), str(store), str(r),
                            str(world), wrap],
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env) for r in range(world)]
    outs = []
    for p in ps:
        out, err = p.communicate(timeout=180)
        assert p.returncode == 0, err[-4000:]
        outs.append(json.loads(out.strip().splitlines()[-1]))
    return outs


def _shard_bytes(root: Path, name: str) -> int:
    m = commit.read_marker(root / "m" / name)
    assert m is not None
    return sum(f.size for f in m.files if f.path.startswith("shard-"))


def test_one_process_without_a_process_group_round_trips_bit_exact(root: Path, tmp_path: Path) -> None:
    (o,) = _run("roundtrip", root, tmp_path, 1)
    assert o["loaded"] == ["global_epoch0_step3", 0, 3], o
    assert o["restored"] and o["resumed"], o           # weights, AdamW state, param_groups, scheduler
    assert o["steps"] == [3.0], o                      # AdamW's step counters
    assert o["extra"] == {"rank": 0, "seen": [3, 0], "rng": True}, o
    assert [c.name for c in commit.scan(root, "m") if c.committed] == ["global_epoch0_step3"]


def test_ddp_on_two_ranks_stored_once_resumed_on_two_and_on_one(root: Path, tmp_path: Path) -> None:
    saved = _run("save", root, tmp_path, 2, wrap="ddp")
    assert [o["name"] for o in saved] == ["global_epoch0_step3"] * 2
    # Replicated across the data-parallel ranks: DCP's planner writes each entry once, so the
    # two-rank checkpoint holds about the bytes of one copy (the per-rank extras are small).
    one, solo = tmp_path / "one", tmp_path / "solo"
    one.mkdir()
    solo.mkdir()
    _run("save", one, solo, 1)
    two, single = _shard_bytes(root, "global_epoch0_step3"), _shard_bytes(one, "global_epoch0_step3")
    assert single < two < 1.1 * single, (two, single)
    loaded = _run("load", root, tmp_path, 2, wrap="ddp")        # latest-load on every rank, into DDP
    for o in loaded:
        assert o["loaded"] == ["global_epoch0_step3", 0, 3] and o["restored"] and o["resumed"], o
        assert o["steps"] == [3.0], o
    assert [o["extra"] for o in loaded] == [{"rank": r, "seen": [3, r], "rng": True} for r in (0, 1)]
    (o,) = _run("load", root, tmp_path, 1)          # one process, no process group, an unwrapped model
    assert o["restored"] and o["resumed"] and o["extra"]["rank"] == 0, o


def test_fsdp2_sharded_on_two_ranks_loads_into_a_plain_model_in_one_process(root: Path, tmp_path: Path) -> None:
    saved = _run("save", root, tmp_path, 2, wrap="fsdp")       # DTensor parameters and AdamW state
    assert [o["name"] for o in saved] == ["global_epoch0_step3"] * 2
    (o,) = _run("load", root, tmp_path, 1)                      # resharded by DCP's planner: 2 -> 1
    assert o["restored"] and o["steps"] == [3.0] and o["extra"]["rank"] == 0, o


def test_what_cannot_be_resumed_is_one_clear_error(root: Path) -> None:
    import torch

    import tiered_ckpt as tc
    from tiered_ckpt.config import NodeConfig
    from tiered_ckpt.errors import UserError
    from tiered_ckpt.training import load_training, save_training

    cfg = NodeConfig(root=str(root), model="m")
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.AdamW(model.parameters())
    assert load_training(model, opt, config=cfg) is None          # a first start: nothing to resume
    save_training(model, epoch=0, step=1, config=cfg)             # the model alone, no scheduler
    with pytest.raises(UserError, match="holds no optim state"):
        load_training(model, opt, config=cfg)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1)
    with pytest.raises(UserError, match="holds no scheduler state"):
        load_training(model, scheduler=sched, config=cfg)
    assert load_training(model, config=cfg).extra is None         # what it holds loads
    tc.save({"w": b"x"}, epoch=0, step=2, config=cfg)             # newest, but not a DCP checkpoint
    with pytest.raises(UserError, match="not saved through torch.distributed.checkpoint"):
        load_training(model, config=cfg)
    with pytest.raises(UserError, match="torch.nn.Module"):
        save_training({"w": torch.zeros(1)}, epoch=0, step=3, config=cfg)  # type: ignore[arg-type]
