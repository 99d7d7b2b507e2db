"""dcp.save / dcp.load through TieredWriter/TieredReader at 1, 2 and 4 real gloo ranks, and a
4-rank save of DTensor Shard(0) state plus an FSDP2 model with its AdamW state (through
get_state_dict) resharded on load at 2 and at 3 ranks: everything bit-exact."""
from __future__ import annotations

import importlib.util
import shutil
from pathlib import Path

import pytest

from tests.toolkit.gloo_ranks import Ranked, run
from tiered_ckpt.io import commit
from tiered_ckpt.io.reader import verify

pytestmark = [pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="torch not installed"),
              pytest.mark.timeout(600)]

BODY = r"""
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Shard, distribute_tensor
from tiered_ckpt.dcp import TieredReader, TieredWriter

def nested():
    g = torch.Generator().manual_seed(5)     # plain tensors are replicated in DCP: the same on every rank
    return {"model": {"f32": torch.randn(37, 5, generator=g), "f64": torch.randn(3, 7, generator=g, dtype=torch.float64),
                      "bf16": torch.randn(9, 4, generator=g).to(torch.bfloat16), "i16": torch.arange(11, dtype=torch.int16) * 3,
                      "i64": torch.arange(5, dtype=torch.int64) - 2**40, "u8": torch.arange(200, dtype=torch.uint8),
                      "bool": torch.tensor([True, False, True]), "empty": torch.empty(0, 3), "scalar": torch.tensor(3.5),
                      "deep": {"x": torch.full((2, 2), -1.25, dtype=torch.float16)}},
            "step": 12000, "lr": 0.000125, "tag": "run-a", "hist": [1, 2.5, "x", [7, None]]}

def zeros_like_state(s):
    return {"model": _z(s["model"]), "step": 0, "lr": 0.0, "tag": "", "hist": []}

def _z(d):
    return {k: _z(v) if isinstance(v, dict) else torch.zeros_like(v) for k, v in d.items()}

def same(a, b):
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    return a.dtype == b.dtype and a.shape == b.shape and bool(torch.equal(a, b))

def full(x):
    return x.full_tensor() if isinstance(x, DTensor) else x

def make_model(mesh):
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(6, 13), torch.nn.ReLU(), torch.nn.Linear(13, 3))
    for layer in m:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(m, mesh=mesh)
    return m, torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.1)

def fulls(msd, osd):
    # FQN -> full tensor of every parameter and optimizer state entry, plus the param_groups
    ps = {k: full(v).clone() for k, v in msd.items()}
    st = {f"{k}/{kk}": full(torch.as_tensor(vv)).clone() for k, s in osd["state"].items() for kk, vv in s.items()}
    return ps, st, [{k: v for k, v in g.items() if k != "params"} for g in osd["param_groups"]]

def sharded(mesh, zeros=False):
    a = torch.arange(13 * 5, dtype=torch.float32).reshape(13, 5) / 7
    b = (torch.arange(13, dtype=torch.float32) - 6.5).to(torch.bfloat16)
    c = torch.arange(6, dtype=torch.int64) * 3
    if zeros:
        a, b, c = torch.zeros_like(a), torch.zeros_like(b), torch.zeros_like(c)
    return {"a": distribute_tensor(a, mesh, [Shard(0)]), "b": distribute_tensor(b, mesh, [Shard(0)]),
            "c": distribute_tensor(c, mesh, [Shard(0)])}

out = {}
if "nested" in A["modes"]:
    want = nested()
    dcp.save(want, storage_writer=TieredWriter(root, "n", epoch=0, step=1))
    got = zeros_like_state(want)
    dcp.load(got, storage_reader=TieredReader(root, "n", epoch=0, step=1, verify_hash=True))
    out["nested_ok"] = same(want["model"], got["model"])
    out["objs"] = [got["step"], got["lr"], got["tag"], got["hist"]]
if "save4" in A["modes"]:
    mesh = init_device_mesh("cpu", (world,))
    model, opt = make_model(mesh)
    g = torch.Generator().manual_seed(1)
    for _ in range(3):
        opt.zero_grad(); model(torch.randn(4, 6, generator=g)).sum().backward(); opt.step()
    msd, osd = get_state_dict(model, opt)
    st = {"model": msd, "optim": osd, "sharded": sharded(mesh), "step": 3}
    dcp.save(st, storage_writer=TieredWriter(root, "s", epoch=0, step=3))
    ps, ss, groups = fulls(msd, osd)
    out["local_rows"] = [int(t.to_local().shape[0]) for t in st["sharded"].values()]
    if rank == 0:
        torch.save({"params": ps, "state": ss, "groups": groups}, A["ref"])
if "load" in A["modes"]:
    mesh = init_device_mesh("cpu", (world,))
    model, opt = make_model(mesh)
    msd, osd = get_state_dict(model, opt)
    st = {"model": msd, "optim": osd, "sharded": sharded(mesh, zeros=True), "step": 0}
    dcp.load(st, storage_reader=TieredReader(root, "s", epoch=0, step=3))
    set_state_dict(model, opt, model_state_dict=st["model"], optim_state_dict=st["optim"])
    ref = torch.load(A["ref"])
    ps, ss, groups = fulls(*get_state_dict(model, opt))
    want = sharded(mesh)
    out["sharded_ok"] = all(same(full(want[k]), full(st["sharded"][k])) for k in want)
    out["params_ok"] = ps.keys() == ref["params"].keys() and all(same(ps[k], ref["params"][k]) for k in ps)
    out["state_ok"] = ss.keys() == ref["state"].keys() and all(same(ss[k], ref["state"][k]) for k in ss)
    out["steps"] = sorted({float(v) for k, v in ss.items() if k.endswith("/step")})
    out["groups_ok"] = groups == ref["groups"]
    out["step"] = st["step"]
    out["local_rows"] = [int(t.to_local().shape[0]) for t in st["sharded"].values()]
report(**out)
leave()
"""

NESTED_OBJS = [12000, 0.000125, "run-a", [1, 2.5, "x", [7, None]]]


def _check_nested(root: Path, outs: list[Ranked], world: int) -> None:
    assert all(o.out["nested_ok"] and o.out["objs"] == NESTED_OBJS for o in outs), [o.out for o in outs]
    d = root / "n" / "global_epoch0_step1"
    m = commit.read_marker(d)
    assert m is not None and m.world_size == world
    assert [c.name for c in commit.scan(root, "n") if c.committed] == ["global_epoch0_step1"]
    assert verify(d, check_hash=True).ok


@pytest.fixture(scope="module")
def saved4(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, list[Ranked]]:
    """One 4-rank run (every rank started at once): the nested round trip, then the sharded save
    that both resharding tests load."""
    tmp = tmp_path_factory.mktemp("dcp4")
    root = tmp / "lustre"
    root.mkdir()
    ref = tmp / "ref.pt"
    return root, ref, run(BODY, 4, tmp / "store", root=str(root), modes=["nested", "save4"], ref=str(ref))


def test_nested_state_round_trip_bit_exact_at_one_rank(root: Path, tmp_path: Path) -> None:
    _check_nested(root, run(BODY, 1, tmp_path / "store", root=str(root), modes=["nested"]), 1)


def test_nested_state_round_trip_bit_exact_at_four_ranks(saved4: tuple[Path, Path, list[Ranked]]) -> None:
    root, _, outs = saved4
    _check_nested(root, outs, 4)


def test_four_rank_sharded_save_is_one_committed_checkpoint(saved4: tuple[Path, Path, list[Ranked]]) -> None:
    root, _, outs = saved4
    assert [o.out["local_rows"] for o in outs] == [[4, 4, 2], [4, 4, 2], [4, 4, 2], [1, 1, 0]]  # 13 and 6 rows over 4
    d = root / "s" / "global_epoch0_step3"
    m = commit.read_marker(d)
    assert m is not None and m.world_size == 4
    assert {f.rank for f in m.files} == {0, 1, 2, 3}     # every rank wrote its shards
    assert verify(d, check_hash=True).ok


@pytest.mark.parametrize("world", [2, 3])
def test_nested_round_trip_and_four_rank_save_resharded_bit_exact(saved4: tuple[Path, Path, list[Ranked]],
                                                                  tmp_path: Path, world: int) -> None:
    _, ref, _ = saved4
    root = tmp_path / "lustre"
    shutil.copytree(saved4[0] / "s", root / "s")    # the 4-rank save; the nested one is made afresh here
    outs = run(BODY, world, tmp_path / "store", root=str(root), modes=["nested", "load"], ref=str(ref))
    _check_nested(root, outs, world)
    for o in outs:
        assert o.out["sharded_ok"] and o.out["params_ok"] and o.out["state_ok"] and o.out["groups_ok"], o.out
        assert o.out["steps"] == [3.0] and o.out["step"] == 3, o.out
    rows = {2: [[7, 7, 3], [6, 6, 3]], 3: [[5, 5, 2], [5, 5, 2], [3, 3, 2]]}[world]
    assert [o.out["local_rows"] for o in outs] == rows
