"""Bad input and faults: each gives one clear error, nothing looks committed, older checkpoints survive."""
from __future__ import annotations

import errno
import os
import subprocess
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import tiered_ckpt as tc
from tiered_ckpt.config import NodeConfig
from tiered_ckpt.errors import ConflictError, IntegrityError, UserError
from tiered_ckpt.io import commit, pipeline, pools, writer
from tiered_ckpt.io.marker import MARKER, Manifest
from tiered_ckpt.io.options import IoOptions
from tiered_ckpt.io.reader import verify


def _committed_ok(path: Path) -> bool:
    return verify(path, check_hash=True).ok


def test_committed_name_is_refused_and_left_untouched(cfg: NodeConfig, root: Path) -> None:
    tc.save({"a": b"first" * 1000}, epoch=0, step=1, config=cfg)
    d = root / "m" / "global_epoch0_step1"
    before = {p.name: (p.stat().st_mtime_ns, p.read_bytes()) for p in d.iterdir()}
    with pytest.raises(ConflictError, match="already a committed checkpoint.*never overwritten"):
        tc.save({"a": b"second" * 1000}, epoch=0, step=1, config=cfg)
    with pytest.raises(ConflictError):
        tc.async_save({"a": b"second"}, epoch=0, step=1, config=cfg)
    assert {p.name: (p.stat().st_mtime_ns, p.read_bytes()) for p in d.iterdir()} == before
    assert bytes(tc.load(config=cfg)["a"]) == b"first" * 1000


def test_incomplete_directory_is_replaced_by_default_or_refused(cfg: NodeConfig, root: Path) -> None:
    d = root / "m" / "global_epoch0_step2"
    d.mkdir(parents=True)
    (d / "shard-r00000-000.bin").write_bytes(b"junk from a crashed attempt")
    (d / "stray.bin").write_bytes(b"x")
    (d / MARKER).write_bytes(b'{"format": "tiered-ckpt/1", "ep')      # torn marker
    with pytest.raises(ConflictError, match="never committed.*overwrite_incomplete"):
        tc.save({"a": b"new"}, epoch=0, step=2, config=cfg, options=IoOptions(overwrite_incomplete=False))
    assert (d / "stray.bin").exists()
    tc.save({"a": b"new"}, epoch=0, step=2, config=cfg)
    assert not (d / "stray.bin").exists()
    assert _committed_ok(d) and bytes(tc.load(config=cfg)["a"]) == b"new"


def test_stale_attempt_that_cannot_be_removed_is_a_user_error(cfg: NodeConfig, root: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """Clearing a crashed attempt can fail (permissions, a vanished mount): one message, no traceback."""
    d = root / "m" / "global_epoch0_step3"
    d.mkdir(parents=True)
    (d / "shard-r00000-000.bin").write_bytes(b"left by a crashed attempt")
    real_unlink = os.unlink

    def refuse(path: str, *a: object, **k: object) -> None:
        if str(path).startswith("shard-"):
            raise PermissionError(errno.EACCES, "Permission denied", str(path))
        real_unlink(path, *a, **k)  # type: ignore[arg-type]

    monkeypatch.setattr(writer.os, "unlink", refuse)
    with pytest.raises(UserError, match=r"cannot write .*global_epoch0_step3.*not committed"):
        tc.save({"a": b"new"}, epoch=0, step=3, config=cfg)
    assert commit.read_marker(d) is None


def test_missing_root_is_a_user_error(cfg: NodeConfig, tmp_path: Path) -> None:
    with pytest.raises(UserError, match=r"does not exist.*--root"):
        tc.save({"a": b"x"}, epoch=0, step=1, config=cfg, root=tmp_path / "nope")
    with pytest.raises(UserError, match="does not exist"):
        tc.load(config=cfg, root=tmp_path / "nope")


def test_unwritable_directory_is_a_user_error(cfg: NodeConfig, tmp_path: Path) -> None:
    ro = tmp_path / "ro"
    ro.mkdir()
    if os.geteuid() == 0:
        if subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(ro)], capture_output=True).returncode:
            pytest.skip("root cannot be denied by permissions and cannot mount a read-only file system here")
    else:
        ro.chmod(0o500)
    try:
        with pytest.raises(UserError, match=r"cannot write .*ro/m"):
            tc.save({"a": b"x"}, epoch=0, step=1, config=cfg, root=ro)
    finally:
        if os.geteuid() == 0:
            subprocess.run(["umount", "-l", str(ro)], check=False)


def test_enospc_midway_commits_nothing_and_spares_older(cfg: NodeConfig, root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    tc.save({"a": os.urandom(1 << 20)}, epoch=0, step=1, config=cfg)
    real, calls = os.pwrite, [0]

    def pwrite(fd: int, data: memoryview, off: int) -> int:
        calls[0] += 1
        if calls[0] > 5:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(fd, data, off)

    monkeypatch.setattr(writer.os, "pwrite", pwrite)
    with pytest.raises(UserError, match="no space left writing .*global_epoch0_step2.*not committed"):
        tc.save({"a": os.urandom(4 << 20)}, epoch=0, step=2, config=cfg)
    monkeypatch.undo()
    info = commit.find(root, "m", "global_epoch0_step2")
    assert info is None or not info.committed
    assert not (root / "m" / "global_epoch0_step2").exists(), "partial files of a failed save are removed"
    assert tc.latest(config=cfg).name == "global_epoch0_step1"  # type: ignore[union-attr]
    assert _committed_ok(root / "m" / "global_epoch0_step1")
    # the pools are whole again: the next save works
    tc.save({"a": os.urandom(2 << 20)}, epoch=0, step=3, config=cfg)


def test_real_enospc_on_a_full_file_system(cfg: NodeConfig, small_tmpfs: Path) -> None:
    (small_tmpfs / "m").mkdir()
    tc.save({"a": b"k" * 300_000}, epoch=0, step=1, config=cfg, root=small_tmpfs)   # tmpfs: no O_DIRECT -> buffered
    with pytest.raises(UserError, match="no space left"):
        tc.save({"a": os.urandom(3 << 20)}, epoch=0, step=2, config=cfg, root=small_tmpfs)
    assert [c.name for c in commit.scan(small_tmpfs, "m") if c.committed] == ["global_epoch0_step1"]
    assert _committed_ok(small_tmpfs / "m" / "global_epoch0_step1")


def test_async_snapshot_lets_caller_change_buffers_after_return(cfg: NodeConfig) -> None:
    a = np.arange(2_000_000, dtype=np.int32)            # 8 MiB through a 1 MiB staging ring
    expect = a.copy()
    h = tc.async_save({"a": a}, epoch=0, step=1, config=cfg)
    a[:] = -1                                           # allowed once async_save returned
    res = h.wait(timeout=60)
    assert h.done() and h.exception() is None and res.name == "global_epoch0_step1"
    assert np.array_equal(tc.load(config=cfg, verify_hash=True)["a"], expect)


def test_async_with_large_staging_returns_before_commit(cfg: NodeConfig, root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    gate = threading.Event()
    real_write_marker = writer.commit.write_marker

    def slow_marker(d: Path, m: Manifest, **kw: Any) -> Path:
        gate.wait(30)
        return real_write_marker(d, m, **kw)

    monkeypatch.setattr(writer.commit, "write_marker", slow_marker)
    h = tc.async_save({"a": os.urandom(3 << 20)}, epoch=0, step=1, config=cfg, options=IoOptions(staging_bytes=8 << 20))
    assert not h.done() and commit.read_marker(root / "m" / "global_epoch0_step1") is None
    gate.set()
    h.wait(30)
    assert _committed_ok(root / "m" / "global_epoch0_step1")


def test_async_failure_is_reported_by_the_handle(cfg: NodeConfig, root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def fsync(fd: int) -> None:
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(writer.os, "fsync", fsync)
    h = tc.async_save({"a": os.urandom(1 << 20)}, epoch=0, step=1, config=cfg, options=IoOptions(staging_bytes=4 << 20))
    err = h.exception(timeout=30)
    assert isinstance(err, UserError) and "not committed" in str(err)
    with pytest.raises(UserError):
        h.wait()
    assert tc.latest(config=cfg) is None


def paused_fill(monkeypatch: pytest.MonkeyPatch) -> tuple[threading.Event, threading.Event]:
    """Hold the copy of the buffers (the writer's, or the async snapshot's into staging): (started, resume)
    events for a test to resize in between."""
    started, resume = threading.Event(), threading.Event()
    real_fill, real_stage = pipeline.Pipeline._fill, pools._copy_one

    def fill(self: pipeline.Pipeline, *a: object) -> None:
        started.set()
        resume.wait(30)
        real_fill(self, *a)  # type: ignore[arg-type]

    def stage(*a: Any) -> None:
        started.set()
        resume.wait(30)
        real_stage(*a)

    monkeypatch.setattr(pipeline.Pipeline, "_fill", fill)
    monkeypatch.setattr(pools, "_copy_one", stage)
    return started, resume


def test_zero_copy_detects_a_buffer_resized_during_the_save(cfg: NodeConfig, root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    tc.save({"a": b"older"}, epoch=0, step=1, config=cfg)
    started, resized = paused_fill(monkeypatch)
    arr = np.zeros(1000, dtype=np.float64)      # small: numpy keeps it on the heap, resizing never unmaps it
    h = tc.async_save({"a": arr}, epoch=0, step=2, config=cfg, zero_copy=True)
    assert started.wait(30)
    arr.resize(2000, refcheck=False)            # the caller broke its promise
    resized.set()
    err = h.exception(timeout=30)
    assert isinstance(err, IntegrityError) and "changed size from 8000 to 16000" in str(err)
    assert not commit.find(root, "m", "global_epoch0_step2") or not commit.find(root, "m", "global_epoch0_step2").committed  # type: ignore[union-attr]
    assert tc.latest(config=cfg).name == "global_epoch0_step1"  # type: ignore[union-attr]


def test_zero_copy_round_trip(cfg: NodeConfig) -> None:
    data = os.urandom(5 << 20)
    h = tc.async_save({"d": data}, epoch=0, step=1, config=cfg, zero_copy=True)
    h.wait(60)
    assert bytes(tc.load(config=cfg, verify_hash=True)["d"]) == data


def test_snapshot_detects_a_buffer_resized_by_another_thread(cfg: NodeConfig, root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    started, resized = paused_fill(monkeypatch)
    arr = np.zeros(1000, dtype=np.float64)

    def other_thread() -> None:
        started.wait(30)
        arr.resize(500, refcheck=False)
        resized.set()

    t = threading.Thread(target=other_thread)
    t.start()
    with pytest.raises(IntegrityError, match="changed size from 8000 to 4000 bytes.*nothing was committed"):
        tc.async_save({"a": arr}, epoch=0, step=1, config=cfg, options=IoOptions(staging_bytes=4 << 20))
    t.join()
    assert not (root / "m" / "global_epoch0_step1").exists()
