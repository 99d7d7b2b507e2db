"""Restore never creates the AMLFS checkpoint root: unmounted, that would fill the OS disk."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tiered_ckpt.config import NodeConfig, dump


def test_restore_refuses_when_amlfs_root_is_missing(tmp_path: Path) -> None:
    root = tmp_path / "lustrefs" / "checkpoints"
    cfg = NodeConfig(root=str(root), backend="amlfs")
    cfg_file = tmp_path / "config.yaml"
    cfg_file.write_text(dump(cfg))
    r = subprocess.run([sys.executable, "-m", "tiered_ckpt", "restore", "--latest", "--config", str(cfg_file)],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2
    assert str(root) in r.stderr and "mount" in r.stderr and "Traceback" not in r.stderr
    assert not root.exists() and not root.parent.exists()
