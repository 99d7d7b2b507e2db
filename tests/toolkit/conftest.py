"""Fixtures for the node toolkit's checkpoint I/O tests: a checkpoint root and a small-I/O config."""
from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from tiered_ckpt.config import IoConfig, NodeConfig


@pytest.fixture
def root(tmp_path: Path) -> Path:
    r = tmp_path / "lustre"
    r.mkdir()
    return r


@pytest.fixture
def cfg(root: Path) -> NodeConfig:
    """Small blocks and pools, so multi-block, multi-file and ring-wrap paths run on small data."""
    return NodeConfig(root=str(root), model="m", backend="local",
                      io=IoConfig(threads=3, files_per_rank=4, block_size=256 << 10,
                                  staging_bytes=1 << 20, sync_buffer_bytes=1 << 20))


@pytest.fixture
def small_tmpfs(tmp_path: Path) -> Iterator[Path]:
    """A real 2 MiB file system, for a real ENOSPC (needs mount rights; skipped otherwise)."""
    mnt = tmp_path / "tiny"
    mnt.mkdir()
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(mnt)],
                                           capture_output=True).returncode != 0:
        pytest.skip("cannot mount a small tmpfs here (needs root)")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)
