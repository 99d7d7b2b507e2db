"""tc.save(state, replicated=[...]): entries the same on every data-parallel rank are written once
(spread over the ranks), every rank loads them; data that differs is refused, never lost; a rank
killed mid-save never leaves a committed checkpoint with a replicated entry missing."""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import tiered_ckpt as tc
from tests.toolkit import index_files
from tiered_ckpt.config import NodeConfig
from tiered_ckpt.errors import IntegrityError
from tiered_ckpt.io import commit, marker, nested, reader
from tiered_ckpt.io.marker import Manifest
from tiered_ckpt.io.reader import verify

needs_torch = pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="torch not installed")

GLOO = r"""
import json, os, sys
import torch
import torch.distributed as dist
import tiered_ckpt as tc
from tiered_ckpt.config import IoConfig, NodeConfig
from tiered_ckpt.errors import UserError
mode, root, store, rank, world = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5])
dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
cfg = NodeConfig(root=root, model="m", io=IoConfig(threads=2, files_per_rank=2, block_size=64 << 10))
g = torch.Generator().manual_seed(0)          # the same model on every rank: data-parallel replicas
model = {f"layer{i}": {"w": torch.randn(64, 96 + 8 * i, generator=g), "b": torch.randn(17, generator=g).half()}
         for i in range(6)}
model["meta"] = {"lr": 0.5, "name": "tiny"}
def state():
    return {"model": model, "mine": torch.full((250_000,), rank, dtype=torch.int32), "step": 5 + rank}
def check(got):
    return bool(all(torch.equal(got["model"][k]["w"], v["w"]) and torch.equal(got["model"][k]["b"], v["b"])
                    and got["model"][k]["b"].dtype == torch.float16 for k, v in model.items() if k != "meta")
                and got["model"]["meta"] == model["meta"] and torch.equal(got["mine"], state()["mine"])
                and got["step"] == 5 + rank)
out = {}
if mode == "ok":
    tc.save(state(), epoch=0, step=1, config=cfg, replicated=["model"])
    out["ok"] = check(tc.load(config=cfg, verify_hash=True))
    into = {"model": {k: {"w": torch.zeros_like(v["w"])} for k, v in model.items() if k != "meta"}}
    got = tc.load(config=cfg, into=into)
    out["into"] = bool(got["model"]["layer3"]["w"] is into["model"]["layer3"]["w"] and check(got))
    read = []
    tc.load(config=cfg, progress=read.append)
    out["read"] = sum(read)
    tc.async_save(state(), epoch=0, step=4, config=cfg, replicated=["model"]).wait(120)
    out["async"] = check(tc.load("global_epoch0_step4", config=cfg))
elif mode == "differ":
    if rank == 1:
        model["layer2"]["w"][3, 4] += 1.0      # one element differs: the "replicas" are not
    try:
        tc.save(state(), epoch=0, step=2, config=cfg, replicated=["model"])
        out["error"] = None
    except UserError as e:
        out["error"] = str(e)
    tc.save(state(), epoch=0, step=3, config=cfg)     # per rank: each rank's own data comes back
    got = tc.load("global_epoch0_step3", config=cfg)
    out["own"] = bool(torch.equal(got["model"]["layer2"]["w"], model["layer2"]["w"]))
print(json.dumps(out), flush=True)
dist.barrier()
os._exit(0)   # gloo teardown at exit sometimes aborts; the ranks agreed above
"""

FILE_MODE = r"""
import json, os, signal, sys
import numpy as np
import tiered_ckpt as tc
from tiered_ckpt.config import IoConfig, NodeConfig
from tiered_ckpt.errors import UserError
from tiered_ckpt.io.options import IoOptions
root, rank, world, sid, kill, rep, wait = (sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5],
                                          sys.argv[6], float(sys.argv[7]))
cfg = NodeConfig(root=root, model="m", io=IoConfig(threads=2, files_per_rank=2, block_size=64 << 10))
rng = np.random.default_rng(0)
state = {"model": {f"p{i}": rng.standard_normal(40_000 + 1000 * i) for i in range(4)},
         "mine": np.full(10, rank, dtype=np.int64)}
def die(n):
    os.kill(os.getpid(), signal.SIGKILL)       # mid-write: some of its share is on disk, its part is not
try:
    tc.save(state, epoch=0, step=1, config=cfg, rank=rank, world_size=world, save_id=sid,
            replicated=["model"] if rep == "1" else None, progress=die if kill == "1" else None,
            options=IoOptions(barrier_timeout=wait))
except UserError as e:
    print(json.dumps({"ok": False, "error": str(e)}))
    sys.exit(e.exit_code)
print(json.dumps({"ok": True}))
"""


def _gloo(mode: str, root: Path, tmp: Path, world: int = 2) -> list[dict[str, Any]]:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    ps = [subprocess.Popen([sys.executable, "-c", GLOO, mode, str(root), str(tmp / f"store-{mode}"), str(r), str(world)],
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env) for r in range(world)]
    outs = []
    for p in ps:
        out, err = p.communicate(timeout=180)
        assert p.returncode == 0, err[-4000:]
        outs.append(json.loads(out.strip().splitlines()[-1]))
    return outs


def _file_mode(root: Path, sid: str, kill: tuple[bool, bool] = (False, False),
               rep: tuple[bool, bool] = (True, True), wait: float = 60) -> list[tuple[int, dict[str, Any]]]:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    ps = [subprocess.Popen([sys.executable, "-c", FILE_MODE, str(root), str(r), "2", sid, "1" if kill[r] else "0",
                            "1" if rep[r] else "0", str(wait)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
          for r in range(2)]
    res = []
    for p in ps:
        out, _ = p.communicate(timeout=120)
        res.append((p.returncode, json.loads(out.strip().splitlines()[-1]) if out.strip() else {}))
    return res


def _shards(m: Manifest) -> dict[int, int]:
    out: dict[int, int] = {}
    for f in m.files:
        if f.path.startswith("shard-"):
            out[f.rank] = out.get(f.rank, 0) + f.size
    return out


@needs_torch
def test_two_gloo_ranks_write_the_replicated_model_once_and_both_load_it(root: Path, tmp_path: Path) -> None:
    outs = _gloo("ok", root, tmp_path)
    assert all(o["ok"] and o["into"] and o["async"] for o in outs), outs
    d = root / "m" / "global_epoch0_step1"
    m = commit.read_marker(d)
    assert m is not None and verify(d, check_hash=True).ok
    model_bytes = sum(64 * (96 + 8 * i) * 4 + 17 * 2 for i in range(6))
    per_rank = _shards(m)
    # Once in all (plus each rank's own 1 MB), and spread: each rank writes about half.
    assert sum(per_rank.values()) == model_bytes + 2 * 1_000_000, per_rank
    assert all(0.35 * model_bytes < n - 1_000_000 < 0.65 * model_bytes for n in per_rank.values()), per_rank
    # A rank reads its own files and, of the other's, only the model's share (not its 1 MB of own data).
    for r, o in enumerate(outs):
        assert per_rank[r] <= o["read"] < per_rank[r] + 0.2 * per_rank[1 - r], (o["read"], per_rank)
    # A rank's load outside the job (no process group) returns the whole model too.
    for r in (0, 1):
        got = tc.load(root=root, model="m", config=NodeConfig(root=str(root), model="m"), rank=r)
        assert sorted(got["model"]) == [f"layer{i}" for i in range(6)] + ["meta"]
        assert got["model"]["layer5"]["w"].shape == (64, 136) and int(got["mine"][0]) == r


@needs_torch
def test_replicated_data_that_differs_between_ranks_is_refused_not_lost(root: Path, tmp_path: Path) -> None:
    outs = _gloo("differ", root, tmp_path)
    for o in outs:
        assert o["error"] and "'model.layer2.w' is declared replicated, but its content differs between rank" in o["error"], o
        assert "nothing was committed" in o["error"] or "not committed" in o["error"], o
        assert o["own"], o          # saved per rank instead, each rank gets its own back
    committed = {c.name for c in commit.scan(root, "m") if c.committed}
    assert committed == {"global_epoch0_step3"}


def test_ranks_that_disagree_on_what_is_replicated_are_refused(root: Path) -> None:
    res = _file_mode(root, "disagree-0", rep=(True, False))
    assert all(rc != 0 for rc, _ in res), res
    assert "replicated=" in res[0][1]["error"] and "not committed" in res[0][1]["error"], res
    assert not [c for c in commit.scan(root, "m") if c.committed]


def test_a_rank_killed_mid_save_never_commits_with_a_replicated_entry_missing(root: Path) -> None:
    res = _file_mode(root, "job1-attempt0", kill=(False, True), wait=5)
    assert res[1][0] == -9 and res[0][0] != 0, res        # rank 1 SIGKILLed; rank 0 gave up
    assert not [c for c in commit.scan(root, "m") if c.committed]
    res = _file_mode(root, "job1-attempt1")              # the next save of the name succeeds
    assert all(rc == 0 for rc, _ in res), res
    m = commit.read_marker(root / "m" / "global_epoch0_step1")
    assert m is not None and set(_shards(m)) == {0, 1}
    rng = np.random.default_rng(0)
    want = {f"p{i}": rng.standard_normal(40_000 + 1000 * i) for i in range(4)}
    for r in (0, 1):
        got = tc.load(root=root, model="m", config=NodeConfig(root=str(root), model="m"), rank=r, verify_hash=True)
        assert all(np.array_equal(got["model"][k], v) for k, v in want.items()) and int(got["mine"][0]) == r


def test_a_marker_naming_a_missing_replicated_buffer_is_not_committed(root: Path) -> None:
    assert all(rc == 0 for rc, _ in _file_mode(root, "s1"))
    d = root / "m" / "global_epoch0_step1"
    raw = index_files.marker(d)
    marker.validate(raw)                                   # as written: valid
    refs = nested.remote_refs(index_files.part(d, 0)[1]["structure"])
    assert refs and all(owner == 1 for owner, _ in refs), refs     # rank 0 left part of the model to rank 1
    owner, name = refs[0]
    before = commit.find(root, "m", "global_epoch0_step1")
    assert before is not None
    for r in (0, 1):                                       # as written: each rank loads the whole model
        assert set(reader.load(before, rank=r)["model"]) == set(reader.load(before, rank=1 - r)["model"])
    v1 = index_files.as_v1(d)                              # the same checkpoint as a format 1 marker
    del v1["index"]["ranks"][str(owner)][name]
    with pytest.raises(marker.InvalidMarker, match=f"names buffer '{name}' of rank {owner}"):
        marker.validate(v1)
    # format 2: the owner's index file no longer holds it (size and hash re-recorded: a valid
    # file, a hostile index) -> neither rank can load (rank 1's own tree names it too); verify says so
    index_files.rewrite_part(d, owner, lambda head, body: body["index"].pop(name))
    info = commit.find(root, "m", "global_epoch0_step1")
    assert info is not None and info.committed             # the marker alone is fine
    with pytest.raises(IntegrityError, match=f"not committed .invalid index .*names buffer '{name}' of rank {owner}"):
        reader.load(info, rank=0)
    with pytest.raises(IntegrityError, match=f"buffer '{name}', which the rank's index does not hold"):
        reader.load(info, rank=1)
    rep = reader.verify(d)
    assert not rep.ok and any(f"names buffer '{name}'" in p for p in rep.problems), rep


def test_one_rank_declaring_replicated_changes_nothing(cfg: NodeConfig, root: Path) -> None:
    state = {"w": np.arange(1000, dtype=np.float32), "b": b"xyz"}
    tc.save(state, epoch=0, step=1, config=cfg, replicated=["w"])
    assert "structure" not in index_files.part(root / "m" / "global_epoch0_step1", 0)[1]   # a flat state's index
    got = tc.load(config=cfg)
    assert np.array_equal(got["w"], state["w"]) and bytes(got["b"]) == b"xyz"


@pytest.mark.parametrize("bad, why", [("model", "pass a list"), (["nope"], "not a top-level key")])
def test_a_bad_replicated_argument_is_one_clear_error(cfg: NodeConfig, bad: Any, why: str) -> None:
    from tiered_ckpt.errors import UserError

    with pytest.raises(UserError, match=why):
        tc.save({"model": {"w": b"x"}}, epoch=0, step=1, config=cfg, replicated=bad)
