"""tc.async_save's staging area: sized to the save, reused, grown, released on request, capped by
its budget (a larger state streams, bit-exact); background failures reach the caller; a SIGKILL
during the background write never leaves a committed partial checkpoint."""
from __future__ import annotations

import errno
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import tiered_ckpt as tc
from tiered_ckpt.config import NodeConfig
from tiered_ckpt.errors import UserError
from tiered_ckpt.io import commit, pools, writer
from tiered_ckpt.io.marker import Manifest
from tiered_ckpt.io.options import IoOptions
from tiered_ckpt.io.reader import verify
from tiered_ckpt.io.sources import SyntheticSource

REPO = Path(__file__).resolve().parents[2]
BIG = IoOptions(staging_bytes=4 << 30)          # the default budget: must never be mapped for a small save


def _idle_staging(timeout: float = 30) -> pools.StagingArea:
    """The staging area once the last save's background write let go of it (done callbacks run
    just after wait() returns)."""
    area = pools.staging_area()
    deadline = time.monotonic() + timeout
    while area.in_use and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not area.in_use
    return area


@pytest.fixture(autouse=True)
def fresh_staging() -> None:
    _idle_staging()
    tc.release_staging()


def test_a_small_save_maps_what_it_needs_not_the_budget(cfg: NodeConfig) -> None:
    before = pools.mapped_bytes()
    a = np.arange(1024, dtype=np.float32)                       # 4 KiB
    h = tc.async_save({"a": a}, epoch=0, step=1, config=cfg, options=BIG)
    area = pools.staging_area()
    assert 0 < area.nbytes <= 64 << 10, area.nbytes             # the 4 KiB, a write ring for it, page rounding
    h.wait(60)
    assert pools.mapped_bytes() - before <= 64 << 10            # nor any other pool of the default sizes
    assert np.array_equal(tc.load(config=cfg, verify_hash=True)["a"], a)


def test_staging_is_reused_grown_and_released(cfg: NodeConfig) -> None:
    area = pools.staging_area()
    rnd = np.random.default_rng(1)
    one = {"w": rnd.integers(0, 1 << 30, size=(1 << 20) // 4, dtype=np.int32)}
    tc.async_save(one, epoch=0, step=1, config=cfg, options=BIG).wait(60)
    mapped, mappings, leases = area.nbytes, area.mappings, area.leases
    assert mapped >= 1 << 20
    tc.async_save(one, epoch=0, step=2, config=cfg, options=BIG).wait(60)
    _idle_staging()
    assert (area.nbytes, area.mappings, area.leases) == (mapped, mappings, leases + 1), "the same area, reused"
    three = {"w": rnd.integers(0, 1 << 30, size=(3 << 20) // 4, dtype=np.int32)}
    tc.async_save(three, epoch=0, step=3, config=cfg, options=BIG).wait(60)
    _idle_staging()
    assert area.nbytes >= 3 << 20 and area.mappings == mappings + 1
    held = area.nbytes
    assert tc.release_staging() == held
    assert area.nbytes == 0 and pools.release_staging() == 0
    tc.async_save(one, epoch=0, step=4, config=cfg, options=BIG).wait(60)      # maps again after a release
    for step, st in ((1, one), (2, one), (3, three), (4, one)):
        got = tc.load(f"global_epoch0_step{step}", config=cfg, verify_hash=True)
        assert np.array_equal(got["w"], st["w"])


def test_a_release_while_a_save_writes_waits_for_it(cfg: NodeConfig, monkeypatch: pytest.MonkeyPatch) -> None:
    gate = threading.Event()
    real = writer.commit.write_marker

    def slow_marker(d: Path, m: Manifest, **kw: Any) -> Path:
        gate.wait(30)
        return real(d, m, **kw)

    monkeypatch.setattr(writer.commit, "write_marker", slow_marker)
    data = os.urandom(2 << 20)
    h = tc.async_save({"d": data}, epoch=0, step=1, config=cfg, options=BIG)
    area = pools.staging_area()
    assert area.in_use and tc.release_staging() == 0 and area.nbytes > 0    # the write still reads it
    gate.set()
    h.wait(60)
    assert _idle_staging().nbytes == 0                                     # released when the save let go
    assert bytes(tc.load(config=cfg, verify_hash=True)["d"]) == data


def test_a_state_beyond_the_budget_streams_bit_exact(cfg: NodeConfig) -> None:
    rnd = np.random.default_rng(2)
    state = {"big": rnd.integers(0, 255, size=5 << 20, dtype=np.uint8),
             "mid": rnd.standard_normal(100_000).astype(np.float32),
             "small": [np.arange(i, dtype=np.int64) for i in range(0, 40, 7)],
             "stream": SyntheticSource(700_000, seed=3), "raw": os.urandom(12345), "step": 9}
    expect = {"big": state["big"].copy(), "mid": state["mid"].copy()}
    budget = 256 << 10                                                    # 1/20 of the state
    h = tc.async_save(state, epoch=0, step=1, config=cfg, options=IoOptions(staging_bytes=budget))
    state["big"][:] = 0                                                   # allowed once async_save returned
    state["mid"][:] = -1
    h.wait(120)
    assert pools.staging_area().peak_bytes <= budget
    got = tc.load(config=cfg, verify_hash=True)
    assert np.array_equal(got["big"], expect["big"]) and np.array_equal(got["mid"], expect["mid"])
    assert [list(a) for a in got["small"]] == [list(range(i)) for i in range(0, 40, 7)]
    ref = bytearray(700_000)
    SyntheticSource(700_000, seed=3).copy_into(0, memoryview(ref))
    assert bytes(got["stream"]) == bytes(ref) and bytes(got["raw"]) == bytes(state["raw"]) and got["step"] == 9


def test_staged_save_lets_the_caller_change_every_kind_of_buffer(cfg: NodeConfig) -> None:
    arr = np.arange(300_000, dtype=np.int32)
    raw = bytearray(os.urandom(100_000))
    stream = SyntheticSource(300_001, seed=5)
    h = tc.async_save({"arr": arr, "raw": raw, "stream": stream, "empty": np.zeros(0)}, epoch=0, step=1,
                      config=cfg, options=BIG)
    expect_arr, expect_raw = arr.copy(), bytes(raw)
    arr[:] = 7
    raw[:] = bytes(len(raw))
    h.wait(60)
    got = tc.load(config=cfg, verify_hash=True)
    ref = bytearray(300_001)
    SyntheticSource(300_001, seed=5).copy_into(0, memoryview(ref))
    assert np.array_equal(got["arr"], expect_arr) and bytes(got["raw"]) == expect_raw
    assert bytes(got["stream"]) == bytes(ref) and got["empty"].size == 0


def test_a_background_failure_nobody_asked_for_is_raised_by_the_next_save(cfg: NodeConfig, root: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    def fsync(fd: int) -> None:
        raise OSError(errno.EIO, "Input/output error")

    with monkeypatch.context() as mp:
        mp.setattr(writer.os, "fsync", fsync)
        h = tc.async_save({"a": os.urandom(1 << 20)}, epoch=0, step=1, config=cfg, options=BIG)
        deadline = time.monotonic() + 60
        while not h.done() and time.monotonic() < deadline:      # done() does not count as looking
            time.sleep(0.01)
        assert h.done()
    with pytest.raises(UserError, match="global_epoch0_step1.*not committed"):
        tc.async_save({"a": b"next"}, epoch=0, step=2, config=cfg)
    assert tc.latest(config=cfg) is None
    # raised once: the save after it runs, and so does the name that failed
    tc.async_save({"a": b"next"}, epoch=0, step=2, config=cfg).wait(60)
    tc.async_save({"a": b"again"}, epoch=0, step=1, config=cfg).wait(60)
    assert bytes(tc.load("global_epoch0_step1", config=cfg)["a"]) == b"again"
    with pytest.raises(UserError), monkeypatch.context() as mp:   # looked at: wait() raised it, the next save runs
        mp.setattr(writer.os, "fsync", fsync)
        tc.async_save({"a": b"x"}, epoch=0, step=3, config=cfg).wait(60)
    tc.async_save({"a": b"y"}, epoch=0, step=4, config=cfg).wait(60)


CHILD = r"""
import os, sys, time
import tiered_ckpt as tc
from tiered_ckpt.config import IoConfig, NodeConfig
from tiered_ckpt.io import pipeline
cfg = NodeConfig(root=sys.argv[1], model="m", backend="local",
                 io=IoConfig(threads=2, files_per_rank=3, block_size=256 << 10, sync_buffer_bytes=1 << 20))
tc.save({"w": b"committed before" * 1000}, epoch=0, step=1, config=cfg)
real = pipeline.pwrite_all
def slow(fd, view, off):
    time.sleep(0.05)                  # a slow file system: the background write takes a while
    return real(fd, view, off)
pipeline.pwrite_all = slow
h = tc.async_save({"w": os.urandom(8 << 20)}, epoch=0, step=2, config=cfg)
print("returned", flush=True)
h.wait()
print("committed", flush=True)
"""


def test_sigkill_during_the_background_write_commits_nothing(root: Path) -> None:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO / "src"), str(REPO)]))
    p = subprocess.Popen([sys.executable, "-c", CHILD, str(root)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True, env=env)
    assert p.stdout is not None
    line = p.stdout.readline()
    assert line == "returned\n", p.communicate(timeout=60)[1][-2000:]
    time.sleep(0.3)                                   # well inside the write (32 blocks x 50 ms on 2 threads)
    p.send_signal(signal.SIGKILL)
    p.wait(timeout=30)
    rest = p.stdout.read()
    p.stdout.close()
    if p.stderr:
        p.stderr.close()
    assert p.returncode == -signal.SIGKILL and "committed" not in rest
    d = root / "m" / "global_epoch0_step2"
    assert commit.read_marker(d) is None, "killed mid-write, yet marked committed"
    assert [c.name for c in commit.scan(root, "m") if c.committed] == ["global_epoch0_step1"]
    assert verify(root / "m" / "global_epoch0_step1", check_hash=True).ok
