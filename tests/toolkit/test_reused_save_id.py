"""A requeued job that reuses its save id (the Slurm job id without the attempt) in file mode:
what commits is this attempt's bytes only (every part carries the nonce of rank 0's claim), and
no clean-up ever removes a file a committed marker lists. Real rank processes, no torch."""
from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

import tiered_ckpt as tc
from tiered_ckpt.config import NodeConfig
from tiered_ckpt.errors import ConflictError
from tiered_ckpt.io import commit
from tiered_ckpt.io.reader import verify

RANK = r"""
import json, os, sys, time
import numpy as np
import tiered_ckpt as tc
from tiered_ckpt.config import IoConfig, NodeConfig
from tiered_ckpt.errors import UserError
from tiered_ckpt.io import save_commit
from tiered_ckpt.io.options import IoOptions
root, rank, sid, fill, crash, delay = sys.argv[1], int(sys.argv[2]), sys.argv[3], float(sys.argv[4]), sys.argv[5] == "1", float(sys.argv[6])
cfg = NodeConfig(root=root, model="m", io=IoConfig(threads=2, files_per_rank=2, block_size=64 << 10,
                                                   sync_buffer_bytes=256 << 10))
if crash:    # the job dies: rank 0 before it commits, rank 1 once its part is published
    def die(*a, **k):
        os._exit(9)
    save_commit.wait_for_parts = die
    save_commit.wait_for_marker = die
time.sleep(delay)
try:
    tc.save({"w": np.full(50_000, fill, np.float32)}, epoch=0, step=7, config=cfg, rank=rank, world_size=2,
            save_id=sid, options=IoOptions(barrier_timeout=20))
    print(json.dumps({"ok": True}), flush=True)
except UserError as e:
    print(json.dumps({"ok": False, "cls": type(e).__name__, "error": str(e)}), flush=True)
    sys.exit(e.exit_code)
"""
NAME = "global_epoch0_step7"


def _rank(root: Path, rank: int, fill: float, crash: bool = False, delay: float = 0.0) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-c", RANK, str(root), str(rank), "job-4242", str(fill), "1" if crash else "0",
                             str(delay)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _result(p: subprocess.Popen[str]) -> tuple[int, dict[str, object], str]:
    out, err = p.communicate(timeout=120)
    lines = [ln for ln in out.splitlines() if ln.startswith("{")]
    return p.returncode, json.loads(lines[-1]) if lines else {}, err


@pytest.mark.parametrize("first", [0, 1])
def test_a_requeued_attempt_reusing_the_save_id_commits_its_own_bytes_only(root: Path, first: int) -> None:
    cfg = NodeConfig(root=str(root), model="m")
    d = root / "m" / NAME
    # Attempt 1 dies after rank 1 published its part, before rank 0 committed.
    a1 = [_result(p) for p in [_rank(root, r, 1.0, crash=True) for r in (0, 1)]]
    assert [rc for rc, _, _ in a1] == [9, 9], [e[-2000:] for _, _, e in a1]
    assert (d / "rank00001.job-4242.part.json").exists() and commit.read_marker(d) is None
    # Attempt 2, same save id; one rank starts 2 s after the other (rank 1 first: it first finds
    # the claim attempt 1 left, and re-binds its part once rank 0's live claim replaces it).
    t0 = time.monotonic()
    ps = {first: _rank(root, first, 2.0), 1 - first: _rank(root, 1 - first, 2.0, delay=2.0)}
    a2 = {r: _result(p) for r, p in ps.items()}
    for r, (rc, out, err) in a2.items():
        assert rc == 0 and out.get("ok"), (r, out, err[-3000:])
    assert time.monotonic() - t0 >= 2.0
    m = commit.read_marker(d)
    assert m is not None and verify(d, check_hash=True).ok
    for r in (0, 1):
        got = np.asarray(tc.load(NAME, config=cfg, rank=r, verify_hash=True)["w"])
        assert (got == 2.0).all(), f"rank {r} loads attempt 1's bytes"
    # A late rank 1 of the same save id (a straggler, or a third attempt's) finds the name
    # committed: refused, and its clean-up removes nothing the marker lists.
    rc, out, err = _result(_rank(root, 1, 3.0))
    assert rc == ConflictError.exit_code and out.get("cls") == "ConflictError", (out, err[-3000:])
    assert commit.read_marker(d) == m and verify(d, check_hash=True).ok
    assert (np.asarray(tc.load(NAME, config=cfg, rank=1, verify_hash=True)["w"]) == 2.0).all()


def test_a_stale_part_of_the_same_save_id_is_never_committed_alone(root: Path) -> None:
    """Rank 0 of a new attempt never takes rank 1's part of the old one: it waits, then fails."""
    d = root / "m" / NAME
    a1 = [_result(p) for p in [_rank(root, r, 1.0, crash=True) for r in (0, 1)]]
    assert [rc for rc, _, _ in a1] == [9, 9]
    code = RANK.replace("barrier_timeout=20", "barrier_timeout=2")
    p = subprocess.run([sys.executable, "-c", code, str(root), "0", "job-4242", "2.0", "0", "0"], capture_output=True,
                       text=True, timeout=60)
    assert p.returncode != 0 and "rank(s) [1] did not finish writing" in p.stdout, (p.stdout, p.stderr[-2000:])
    assert commit.read_marker(d) is None
