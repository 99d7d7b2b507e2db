"""Planted files at retention's locks: one hostile lock file costs one checkpoint, never the run;
the run's own lock is never created through a symlinked model directory. `retention apply` runs
as a real process (the CLI) against Azurite."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.lifecycle.helpers import REPO, local_cfg, make_checkpoint
from tiered_ckpt.config import dump
from tiered_ckpt.io import commit
from tiered_ckpt.io.lock import CHECKPOINT_LOCKS, LOCK_NAME
from tiered_ckpt.lifecycle.exporter import Exporter
from tiered_ckpt.tiers.blob import BlobStore


def _apply(conf: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "tiered_ckpt.cli.app", "retention", "apply", "--config", str(conf),
                           "--json"], cwd=REPO, capture_output=True, text=True, timeout=120)


@pytest.fixture
def archived(tmp_path: Path, azurite_container: tuple[str, str]):
    conn, container = azurite_container
    root = tmp_path / "lustre"
    root.mkdir()
    cfg = local_cfg(root, conn, container, keep_last=1, min_keep=1, restore_grace=0)
    for step in (1, 2, 3):
        make_checkpoint(root, "m", 0, step)
    Exporter(cfg, BlobStore(cfg.archive, backoff=0.01), status_path=tmp_path / "st.json").iterate()
    conf = tmp_path / "node.yaml"
    conf.write_text(dump(cfg))
    return cfg, conf, tmp_path


@pytest.mark.parametrize("planted", ["symlink", "fifo"])
def test_a_planted_lock_file_skips_that_checkpoint_and_the_run_goes_on(archived, planted: str) -> None:
    cfg, conf, tmp = archived
    locks = Path(cfg.root) / "m" / CHECKPOINT_LOCKS
    locks.mkdir(exist_ok=True)
    victim = tmp / "victim.txt"
    victim.write_text("not yours")
    lock = locks / "global_epoch0_step1.lock"
    if planted == "symlink":
        lock.symlink_to(victim)
    else:
        os.mkfifo(lock)
    r = _apply(conf)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    by = {d["name"]: d for d in out["checkpoints"]}
    assert by["global_epoch0_step1"]["decision"] == "skip"
    assert "lock file" in str(by["global_epoch0_step1"]["reason"])
    assert by["global_epoch0_step2"]["decision"] == "delete"                    # the others were freed
    assert commit.read_marker(Path(cfg.root) / "m" / "global_epoch0_step1") is not None
    assert commit.read_marker(Path(cfg.root) / "m" / "global_epoch0_step2") is None
    assert victim.read_text() == "not yours"


def test_the_run_lock_is_never_created_through_a_symlinked_model_directory(archived) -> None:
    cfg, conf, tmp = archived
    outside = tmp / "elsewhere"
    (Path(cfg.root) / "m").rename(outside)
    (Path(cfg.root) / "m").symlink_to(outside)
    r = _apply(conf)
    assert r.returncode != 0
    text = r.stdout + r.stderr
    assert "symbolic link" in text and "Traceback" not in text
    assert not (outside / LOCK_NAME).exists()
    assert commit.read_marker(outside / "global_epoch0_step1") is not None        # nothing touched
