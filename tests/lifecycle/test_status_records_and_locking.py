"""`tiered-ckpt status` says when the records cannot be written (a root-owned mount root: every
writer's record is skipped, metrics and the timeline stay empty) and when the claim's flock is
not coherent across nodes (a Lustre client mounted with localflock or noflock); the claim itself
refuses such a mount. Real processes; the mount table is a fake /proc/mounts file."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.lifecycle.helpers import REPO
from tiered_ckpt.io import mounts

NOBODY = 65534


def _status(conf: Path, *, user: int | None = None, env: dict[str, str] | None = None) -> tuple[int, dict]:
    cmd = [sys.executable, "-m", "tiered_ckpt.cli.app", "status", "--config", str(conf), "--json"]
    if user is not None:
        cmd = ["setpriv", f"--reuid={user}", f"--regid={user}", "--clear-groups", *cmd]
    r = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=120,
                       env=dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path), **(env or {})))
    assert "Traceback" not in r.stderr, r.stderr
    return r.returncode, json.loads(r.stdout)


def _check(st: dict, part: str) -> dict:
    return next(c for c in st["checks"] if c["part"] == part)


@pytest.fixture
def shared() -> Iterator[Path]:
    """A directory other users can traverse (pytest's tmp_path is root's, 0700)."""
    d = Path(tempfile.mkdtemp(prefix="tc-status-"))
    d.chmod(0o755)
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("setpriv") is None, reason="needs root to run as another user")
def test_a_records_directory_the_user_cannot_create_or_write_is_one_status_problem(shared: Path) -> None:
    # The other user runs this checkout's code: a clone inside a 0700 directory (mktemp -d) is closed to it.
    probe = subprocess.run(["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups", sys.executable,
                            "-c", "import tiered_ckpt.cli.app"], cwd="/", capture_output=True, timeout=60,
                           env=dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path)))
    if probe.returncode != 0:
        pytest.skip(f"uid {NOBODY} cannot import the toolkit from {REPO} (a parent directory is closed to it)")
    mnt = shared / "lustrefs"                      # the mount root: root-owned, 0755
    mnt.mkdir()
    mnt.chmod(0o755)
    root = mnt / "checkpoints"
    root.mkdir()
    root.chmod(0o2777)
    conf = shared / "node.yaml"
    conf.write_text(f"root: {root}\nmodel: m\nbackend: local\n")
    conf.chmod(0o644)
    rc, st = _status(conf, user=NOBODY)
    c = _check(st, "records")
    assert rc == 1 and c["state"] == "PROBLEM"
    assert str(mnt / ".checkpoints.records") in c["reason"] and "cannot be created" in c["reason"]
    base = mnt / ".checkpoints.records"            # created, but not for this user's group
    base.mkdir()
    base.chmod(0o2775)
    rc, st = _status(conf, user=NOBODY)
    assert rc == 1 and "not writable by this user" in _check(st, "records")["reason"]
    base.chmod(0o2777)                             # what the boot's group-shared mode gives the group
    rc, st = _status(conf, user=NOBODY)
    assert _check(st, "records")["state"] == "ok"


def _fake_mounts(shared: Path, root: Path, options: str) -> Path:
    f = shared / "mounts"
    f.write_text("sysfs /sys sysfs rw,nosuid 0 0\n"
                 "/dev/sda1 / ext4 rw,relatime 0 0\n"
                 f"10.0.0.4@tcp:/lustrefs {os.path.realpath(root.parent)} lustre {options} 0 0\n")
    return f


SAVE = r"""
import sys
import numpy as np
import tiered_ckpt as tc
from tiered_ckpt.errors import UserError
try:
    tc.save({"w": np.arange(4.0)}, root=sys.argv[1], model="m", epoch=0, step=1)
    print("saved")
except UserError as e:
    print("refused:", e)
"""


@pytest.mark.parametrize("options,refused", [("rw,localflock,lazystatfs", True), ("rw,lazystatfs", True),
                                             ("rw,flock,lazystatfs", False)])
def test_the_claim_and_status_refuse_a_lustre_mount_without_coherent_flock(shared: Path, options: str,
                                                                           refused: bool) -> None:
    root = shared / "lustrefs" / "checkpoints"
    root.mkdir(parents=True)
    env = {mounts.MOUNTS_ENV: str(_fake_mounts(shared, root, options))}
    r = subprocess.run([sys.executable, "-c", SAVE, str(root)], capture_output=True, text=True, timeout=120,
                       env=dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path), **env))
    assert r.returncode == 0, r.stderr
    if refused:
        assert r.stdout.startswith("refused:") and "-o flock" in r.stdout, r.stdout
        assert not (root / "m" / "global_epoch0_step1" / "COMMITTED.json").exists()
    else:
        assert r.stdout.strip() == "saved", r.stdout + r.stderr
    conf = shared / "node.yaml"
    conf.write_text(f"root: {root}\nmodel: m\nbackend: local\n")
    _, st = _status(conf, env=env)
    c = _check(st, "locking")
    assert c["state"] == ("PROBLEM" if refused else "ok")
    if refused:
        assert ("localflock" if "localflock" in options else "noflock") in c["reason"]


def test_mount_lookup_takes_the_longest_mount_point_and_unescapes_spaces(tmp_path: Path) -> None:
    table = mounts.parse("/dev/sda1 / ext4 rw 0 0\n"
                         r"mgs:/fs /mnt/lustre\040fs lustre rw,localflock 0 0" "\n"
                         "mgs:/fs2 /mnt lustre rw,flock 0 0\n")
    assert mounts.mount_of("/mnt/lustre fs/ckpt/m", table).point == "/mnt/lustre fs"            # type: ignore[union-attr]
    assert mounts.flock_problem("/mnt/lustre fs/ckpt", table) is not None
    assert mounts.flock_problem("/mnt/other", table) is None
    assert mounts.flock_problem("/home/x", table) is None                                        # ext4: not Lustre
