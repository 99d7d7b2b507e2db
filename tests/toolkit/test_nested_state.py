"""Nested state through the native API: model + optimizer state dicts, lists, scalars, into=."""
from __future__ import annotations

import json
import math
from collections import OrderedDict
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import tiered_ckpt as tc
from tests.toolkit import index_files
from tiered_ckpt.config import NodeConfig
from tiered_ckpt.errors import UserError
from tiered_ckpt.io import commit, reader
from tiered_ckpt.io.marker import MARKER, InvalidMarker, parse_marker, validate

needs_torch = pytest.mark.skipif(__import__("importlib").util.find_spec("torch") is None, reason="torch not installed")


def _equal(a: Any, b: Any) -> bool:
    """Deep equality with types: tensors/arrays bit-exact and of the same dtype and shape."""
    import torch

    if type(a) is not type(b):
        return False
    if isinstance(a, torch.Tensor):
        return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.reshape(-1).view(torch.uint8),
                                                                          b.reshape(-1).view(torch.uint8))
    if isinstance(a, dict):
        return list(a) == list(b) and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b)


def _trained() -> tuple[Any, Any]:
    import torch

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    model[2].to(torch.bfloat16)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95), weight_decay=0.01)
    x = torch.randn(5, 8)
    loss = model[2](model[1](model[0](x)).to(torch.bfloat16)).float().pow(2).mean()
    loss.backward()
    opt.step()
    return model, opt


@needs_torch
def test_model_and_adamw_state_round_trip_bit_exact_and_load_back(cfg: NodeConfig, root: Path) -> None:
    import torch

    model, opt = _trained()
    state = {"model": model.state_dict(), "optim": opt.state_dict(), "step": 3, "note": "x"}
    tc.save(state, epoch=1, step=3, config=cfg)
    out = tc.load(config=cfg, verify_hash=True)

    assert _equal(out["model"], state["model"]) and isinstance(out["model"], OrderedDict)
    assert out["step"] == 3 and out["note"] == "x"
    assert list(out["optim"]["state"]) == [0, 1, 2, 3]                      # int keys stay ints
    assert _equal(out["optim"]["state"], state["optim"]["state"])            # exp_avg, exp_avg_sq, step tensors
    assert out["optim"]["param_groups"] == state["optim"]["param_groups"]   # lr, betas tuple, params ids, flags
    assert isinstance(out["optim"]["param_groups"][0]["betas"], tuple)
    assert out["model"]["2.weight"].dtype == torch.bfloat16

    fresh = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    fresh[2].to(torch.bfloat16)
    fresh.load_state_dict(out["model"])
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=0.5)
    fresh_opt.load_state_dict(out["optim"])
    assert fresh_opt.param_groups[0]["lr"] == 1e-3 and fresh_opt.param_groups[0]["betas"] == (0.9, 0.95)
    for p, q in zip(model.parameters(), fresh.parameters(), strict=True):
        assert torch.equal(p, q)
        assert _equal(opt.state[p], fresh_opt.state[q])

    # the structure is in the rank's index file (and validates), the buffers under their paths
    head, body = index_files.part(root / "m" / "global_epoch1_step3", 0)
    assert "structure" in body and "optim.state.3.exp_avg" in body["index"]
    m = commit.read_marker(root / "m" / "global_epoch1_step3")
    assert m is not None and reader.read_index(root / "m" / "global_epoch1_step3", m, 0).structure == body["structure"]


def test_numpy_nested_lists_and_scalars(cfg: NodeConfig) -> None:
    rng = np.random.default_rng(1)
    state = {"layers": [{"w": rng.standard_normal((3, 5)).astype(np.float16), "b": np.arange(5)} for _ in range(3)],
             "pair": (b"raw", np.zeros((0, 4), np.float32)), "cfg": {"lr": 0.1, "warm": True, "tag": None},
             "inf": -math.inf, "big": 2 ** 70, "a.b": b"1", "a": {"b": b"2"}, "empty": {}, "none": []}
    tc.save(state, epoch=0, step=1, config=cfg)
    out = tc.load(config=cfg, verify_hash=True)
    assert isinstance(out["layers"], list) and len(out["layers"]) == 3
    for got, want in zip(out["layers"], state["layers"], strict=True):
        for k in ("w", "b"):
            assert isinstance(got[k], np.ndarray) and got[k].dtype == want[k].dtype and np.array_equal(got[k], want[k])
    assert isinstance(out["pair"], tuple) and bytes(out["pair"][0]) == b"raw" and out["pair"][1].shape == (0, 4)
    assert out["cfg"] == {"lr": 0.1, "warm": True, "tag": None} and out["inf"] == -math.inf and out["big"] == 2 ** 70
    assert bytes(out["a.b"]) == b"1" and bytes(out["a"]["b"]) == b"2"       # same dotted path, two buffers
    assert out["empty"] == {} and out["none"] == []


def test_load_into_a_nested_structure_fills_in_place(cfg: NodeConfig) -> None:
    w, b = np.arange(12, dtype=np.float32).reshape(3, 4), np.arange(4, dtype=np.int64)
    tc.save({"net": {"w": w, "b": b}, "bufs": [b"abcd", b"xy"], "step": 9}, epoch=0, step=2, config=cfg)
    dw, dbuf = np.zeros_like(w), bytearray(4)
    out = tc.load(config=cfg, into={"net": {"w": dw}, "bufs": [dbuf, None]})
    assert out["net"]["w"] is dw and np.array_equal(dw, w)        # filled in place
    assert out["bufs"][0] is dbuf and dbuf == b"abcd"
    assert np.array_equal(out["net"]["b"], b) and bytes(out["bufs"][1]) == b"xy" and out["step"] == 9
    with pytest.raises(UserError, match=r"net\.nope: not in checkpoint"):
        tc.load(config=cfg, into={"net": {"nope": dw}})
    with pytest.raises(UserError, match=r"bufs: .*sequence of 2"):
        tc.load(config=cfg, into={"bufs": [dbuf]})
    with pytest.raises(UserError, match=r"net\.w.: buffer has 12 bytes, checkpoint .* holds 48"):
        tc.load(config=cfg, into={"net": {"w": np.zeros(3, np.float32)}})


@needs_torch
def test_load_into_a_fresh_model_state_dict_in_place(cfg: NodeConfig) -> None:
    import torch

    model, _ = _trained()
    tc.save({"model": model.state_dict()}, epoch=0, step=4, config=cfg)
    fresh = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    fresh[2].to(torch.bfloat16)
    dest = fresh.state_dict()
    out = tc.load(config=cfg, into={"model": dest})
    assert all(out["model"][k] is dest[k] for k in dest)
    for p, q in zip(model.parameters(), fresh.parameters(), strict=True):
        assert torch.equal(p, q)


@pytest.mark.parametrize("state, path", [
    ({"optim": {"state": {3: {(1, 2): b"x"}}}}, "optim.state.3.(1, 2)"),
    ({"a": {True: b"x"}}, "a.True"),
    ({"a": [{1.5: b"x"}]}, "a.0.1.5"),
    ({"a": {"b": {None: 1}}}, "a.b.None"),
])
def test_refused_key_types_name_the_path(cfg: NodeConfig, state: dict[str, Any], path: str) -> None:
    with pytest.raises(UserError) as err:
        tc.save(state, epoch=0, step=1, config=cfg)
    assert path in str(err.value) and "keys must be str or int" in str(err.value)


def test_refused_values_and_cycles_name_the_path(cfg: NodeConfig) -> None:
    with pytest.raises(UserError, match=r"'optim\.state\.3\.exp_avg' \(set\) is not a buffer"):
        tc.save({"optim": {"state": {3: {"exp_avg": {1, 2}}}}}, epoch=0, step=1, config=cfg)
    loop: dict[str, Any] = {"x": b"1"}
    loop["me"] = [loop]
    with pytest.raises(UserError, match=r"me\.0\.me contains itself"):
        tc.save({"s": 1, **loop}, epoch=0, step=1, config=cfg)
    with pytest.raises(UserError, match="not C-contiguous"):
        tc.save({"a": [np.zeros((10, 10))[:, 1]]}, epoch=0, step=1, config=cfg)


def test_flat_state_marker_has_no_structure_and_old_markers_still_load(cfg: NodeConfig, root: Path) -> None:
    # A flat mapping of buffers is today's format: no structure anywhere, buffers under their keys.
    tc.save(OrderedDict(w=np.arange(4, dtype=np.float32), b=b"xy"), epoch=0, step=1, config=cfg)
    head, body = index_files.part(root / "m" / "global_epoch0_step1", 0)
    assert set(body) == {"index"} and list(body["index"]) == ["w", "b"]
    out = tc.load(config=cfg)
    assert type(out) is dict and np.array_equal(out["w"], np.arange(4, dtype=np.float32)) and bytes(out["b"]) == b"xy"

    # A marker as the released writer wrote it (no save_id, old file names, no structure) still loads.
    d = root / "m" / "global_epoch0_step2"
    d.mkdir()
    (d / "shard-r00000-000.bin").write_bytes(b"hello")
    part_bytes = b"{}"
    (d / "rank00000.part.json").write_bytes(part_bytes)
    old = {"created_utc": "2024-05-01T10:00:00+00:00", "epoch": 0, "format": "tiered-ckpt/1", "hash_algo": "xxh3_128",
           "step": 2, "world_size": 1,
           "files": [{"hash": None, "path": "shard-r00000-000.bin", "rank": 0, "size": 5},
                     {"hash": None, "path": "rank00000.part.json", "rank": 0, "size": 2}],
           "index": {"save_id": None, "ranks": {"0": {"g": {"kind": "bytes", "dtype": None, "shape": None, "nbytes": 5,
                                                            "segments": [["shard-r00000-000.bin", 0, 5, 0]]}}}}}
    (d / MARKER).write_text(json.dumps(old, indent=1, sort_keys=True))
    out = tc.load("global_epoch0_step2", config=cfg)
    assert list(out) == ["g"] and bytes(out["g"]) == b"hello"


def _with_structure(tree: Any) -> dict[str, Any]:
    return {"format": "tiered-ckpt/1", "epoch": 0, "step": 1,
            "files": [{"path": "a.bin", "size": 4, "hash": None, "rank": 0}],
            "index": {"save_id": None,
                      "ranks": {"0": {"b": {"kind": "bytes", "dtype": None, "shape": None, "nbytes": 4,
                                            "segments": [["a.bin", 0, 4, 0]]}}},
                      "structure": {"0": tree}}}


@pytest.mark.parametrize("tree, needle", [
    ({"dict": [["x", {"buf": "b"}], [7, {"val": 1.5}], ["f", {"float": "nan"}], ["t", {"tuple": []}]]}, ""),
    ({"dict": [["x", {"buf": "nope"}]]}, "does not hold"),
    ({"dict": [[True, {"val": 1}]]}, "not [str or int key, node]"),
    ({"dict": [["x", {"val": 1}], ["x", {"val": 2}]]}, "key 'x' twice"),
    ({"list": [{"val": [1]}]}, "not a JSON scalar"),
    ({"list": [{"float": "1e999"}]}, "not one of"),
    ({"set": []}, "not one of"),
    ({"buf": "b", "val": 1}, "not one of"),
    ({"list": {"val": 1}}, "not a list"),
])
def test_marker_structure_is_validated(tree: Any, needle: str) -> None:
    d = _with_structure(tree)
    if not needle:
        assert validate(d).index["structure"]["0"] == tree
        return
    with pytest.raises(InvalidMarker) as err:
        parse_marker(json.dumps(d))
    assert needle in str(err.value) and "\n" not in str(err.value)
    d["index"]["structure"] = {"1": {"val": 1}}
    with pytest.raises(InvalidMarker, match="not a rank of index.ranks"):
        validate(d)
    d["index"]["structure"] = []
    with pytest.raises(InvalidMarker, match="not a mapping"):
        validate(d)


RANK = r"""
import sys
import tiered_ckpt as tc
from tiered_ckpt.config import IoConfig, NodeConfig
root, rank = sys.argv[1], int(sys.argv[2])
cfg = NodeConfig(root=root, model="m", io=IoConfig(threads=2, files_per_rank=2, block_size=64 << 10))
state = {"shards": [bytes([rank + 1]) * (50_000 + rank)] * (rank + 1), "rank": rank, "meta": {"of": [rank, 2]}}
tc.save(state, epoch=0, step=5, config=cfg, rank=rank, world_size=2, save_id="nested-job1")
"""


def test_each_rank_records_its_own_structure(cfg: NodeConfig, root: Path) -> None:
    import subprocess
    import sys

    procs = [subprocess.Popen([sys.executable, "-c", RANK, str(root), str(r)], stderr=subprocess.PIPE, text=True)
             for r in (0, 1)]
    for p in procs:
        _, err = p.communicate(timeout=120)
        assert p.returncode == 0, err
    for r in (0, 1):
        out = tc.load(config=cfg, rank=r, verify_hash=True)
        assert out["rank"] == r and out["meta"] == {"of": [r, 2]}
        assert [bytes(s) for s in out["shards"]] == [bytes([r + 1]) * (50_000 + r)] * (r + 1)
    assert all("structure" in index_files.part(root / "m" / "global_epoch0_step5", r)[1] for r in (0, 1))


def test_async_save_snapshots_the_nested_state(cfg: NodeConfig) -> None:
    w = np.arange(1000, dtype=np.float64)
    state = {"opt": {"state": {0: {"m": w}}, "groups": [{"lr": 0.5, "params": [0]}]}, "step": 1}
    h = tc.async_save(state, epoch=0, step=6, config=cfg)
    w += 1                                    # after the snapshot: not in the checkpoint
    state["step"] = 2
    h.wait()
    out = tc.load(config=cfg)
    assert np.array_equal(out["opt"]["state"][0]["m"], np.arange(1000, dtype=np.float64)) and out["step"] == 1
    assert out["opt"]["groups"] == [{"lr": 0.5, "params": [0]}]
