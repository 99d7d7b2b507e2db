"""Several real writer processes (no torch): each rank writes its own files, rank 0 commits once all are done."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

import tiered_ckpt as tc
from tiered_ckpt.config import NodeConfig
from tiered_ckpt.errors import UserError
from tiered_ckpt.io import commit
from tiered_ckpt.io.reader import verify

RANK = r"""
import json, sys
import tiered_ckpt as tc
from tiered_ckpt.config import IoConfig, NodeConfig
from tiered_ckpt.errors import UserError
from tiered_ckpt.io.options import IoOptions
root, rank, world, sid, timeout = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], float(sys.argv[5])
cfg = NodeConfig(root=root, model="m", io=IoConfig(threads=2, files_per_rank=2, block_size=64 << 10))
data = bytes([rank + 1]) * (100_000 + rank * 12_345)
try:
    tc.save({"w": data, "rank": str(rank).encode()}, epoch=0, step=1, config=cfg, rank=rank, world_size=world,
            save_id=sid, options=IoOptions(barrier_timeout=timeout))
except UserError as e:
    print(json.dumps({"ok": False, "error": str(e)}))
    sys.exit(e.exit_code)
print(json.dumps({"ok": True}))
"""


def _start(root: Path, rank: int, world: int, sid: str, timeout: float = 60) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-c", RANK, str(root), str(rank), str(world), sid, str(timeout)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _result(p: subprocess.Popen[str]) -> tuple[int, dict[str, object], str]:
    out, err = p.communicate(timeout=120)
    return p.returncode, (json.loads(out.strip().splitlines()[-1]) if out.strip() else {}), err


def test_three_ranks_commit_once_with_every_ranks_files(cfg: NodeConfig, root: Path) -> None:
    procs = [_start(root, r, 3, "job7-attempt0") for r in (2, 0, 1)]    # started out of order on purpose
    for p in procs:
        rc, out, err = _result(p)
        assert rc == 0 and out["ok"], (out, err)
    d = root / "m" / "global_epoch0_step1"
    m = commit.read_marker(d)
    assert m is not None and m.world_size == 3
    by_rank = {r: sorted(f.path for f in m.files if f.rank == r) for r in range(3)}
    for r in range(3):
        assert f"rank{r:05d}.job7-attempt0.part.json" in by_rank[r]
        assert len([p for p in by_rank[r] if p.endswith(".bin")]) == 2
    assert verify(d, check_hash=True).ok
    for r in range(3):
        out = tc.load(config=cfg, rank=r, verify_hash=True)
        assert bytes(out["w"]) == bytes([r + 1]) * (100_000 + r * 12_345) and bytes(out["rank"]) == str(r).encode()


def test_a_missing_rank_means_nothing_is_committed(root: Path) -> None:
    procs = [_start(root, r, 3, "job8-attempt0", timeout=1.5) for r in (0, 1)]   # rank 2 never comes
    (rc0, out0, err0), (rc1, out1, err1) = (_result(p) for p in procs)
    assert rc0 != 0 and "rank(s) [2] did not finish" in str(out0["error"]) and "nothing was committed" in str(out0["error"])
    assert rc1 != 0 and "rank 0 could not commit" in str(out1["error"])
    assert "Traceback" not in err0 + err1
    assert commit.read_marker(root / "m" / "global_epoch0_step1") is None


def test_parts_of_a_crashed_earlier_attempt_are_never_committed(root: Path) -> None:
    first = [_start(root, r, 2, "job9-attempt0", timeout=1.0) for r in (0, 1)]
    for p in first:
        assert _result(p)[0] == 0
    # an attempt that crashed before committing leaves its part behind under another name
    d = root / "m" / "global_epoch0_step2"
    d.mkdir()
    (d / "rank00001.job9-attempt0.part.json").write_text(json.dumps({"save_id": "job9-attempt0", "files": [], "index": {}}))
    p0 = subprocess.Popen([sys.executable, "-c", RANK.replace("step=1", "step=2"), str(root), "0", "2", "job9-attempt1", "1.0"],
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    rc, out, _ = _result(p0)
    assert rc != 0 and "did not finish" in str(out["error"])
    assert commit.read_marker(d) is None


def test_several_ranks_without_torch_need_a_save_id(cfg: NodeConfig) -> None:
    with pytest.raises(UserError, match="save_id"):
        tc.save({"a": b"x"}, epoch=0, step=1, config=cfg, rank=0, world_size=2)
    with pytest.raises(UserError, match="both rank= and world_size="):
        tc.save({"a": b"x"}, epoch=0, step=1, config=cfg, rank=0)
