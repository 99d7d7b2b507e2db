"""Archive retention and a restore from the archive in two real processes against Azurite: a
restore that is reading a checkpoint keeps it (retention keeps it this run), and a restore that
starts while retention is deleting that checkpoint stops cleanly; never a restore that fails
half-way because its blobs went (restore_lease.py)."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.lifecycle.helpers import local_cfg, make_checkpoint
from tiered_ckpt.config import dump
from tiered_ckpt.io import commit
from tiered_ckpt.lifecycle.exporter import Exporter
from tiered_ckpt.tiers.blob import BlobStore

STEPS = (1, 2, 3)

RESTORE = r"""
import json, os, sys, time
from tiered_ckpt import config
from tiered_ckpt.errors import UserError
from tiered_ckpt.lifecycle.restore import restore
from tiered_ckpt.tiers.backends import LocalBackend
from tiered_ckpt.tiers.blob import BlobStore
A = json.loads(sys.argv[1])
cfg = config.load(A["conf"])
orig = LocalBackend.rehydrate

def slow(self, m, d, progress):                  # paused mid-restore, after it chose the checkpoint
    open(A["reading"], "w").close()
    while not os.path.exists(A["go"]):
        time.sleep(0.05)
    return orig(self, m, d, progress)

LocalBackend.rehydrate = slow
if A.get("after"):
    while not os.path.exists(A["after"]):
        time.sleep(0.05)
try:
    r = restore(cfg, LocalBackend(cfg, BlobStore(cfg.archive, backoff=0.01)), A["name"], lock_wait=0)
    print(json.dumps({"ok": True, "source": r.source}))
except UserError as e:
    print(json.dumps({"ok": False, "error": str(e), "exit_code": e.exit_code}))
"""

RETENTION = r"""
import json, os, sys, time
from tiered_ckpt import config
from tiered_ckpt.lifecycle import archive_retention as ar
from tiered_ckpt.lifecycle.policy import Policy
from tiered_ckpt.tiers.blob import BlobStore
A = json.loads(sys.argv[1])
cfg = config.load(A["conf"])

def step(name, what):
    if name != A["name"]:
        return
    if what == "journal" and A.get("wait_for"):        # evaluated already; the restore starts now
        while not os.path.exists(A["wait_for"]):
            time.sleep(0.05)
    if what == "marker" and A.get("journaled"):
        open(A["journaled"], "w").close()
        while not os.path.exists(A["go"]):
            time.sleep(0.05)

res = ar.apply(cfg, BlobStore(cfg.archive, backoff=0.01), Policy(keep_last=1, min_keep=1), ar.on_lustre(cfg),
               on_step=step)
print(json.dumps({d.name: [d.action, d.reason] for d in res.decisions}))
"""


def _start(script: str, **args: object) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-c", script, json.dumps(args)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path)))


def _wait_for(p: Path, procs: list[subprocess.Popen[str]], timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not p.exists():
        for pr in procs:
            assert pr.poll() is None, pr.communicate()[1][-3000:]
        assert time.monotonic() < deadline, f"{p} never appeared"
        time.sleep(0.05)


def _out(p: subprocess.Popen[str]) -> dict:
    out, err = p.communicate(timeout=120)
    assert p.returncode == 0, err[-3000:]
    return json.loads(out.strip().splitlines()[-1])


@pytest.fixture
def only_in_archive(tmp_path: Path, azurite_container: tuple[str, str]):
    conn, container = azurite_container
    root = tmp_path / "lustre"
    root.mkdir()
    cfg = local_cfg(root, conn, container, keep_last=1, min_keep=1, restore_grace=0)
    for s in STEPS:
        make_checkpoint(root, "m", 0, s, {"a.bin": os.urandom(300_000 + s)})
    Exporter(cfg, BlobStore(cfg.archive, backoff=0.01), status_path=tmp_path / "export.json").iterate()
    originals = {s: (root / "m" / f"global_epoch0_step{s}" / "a.bin").read_bytes() for s in STEPS}
    for s in STEPS[:-1]:
        shutil.rmtree(root / "m" / f"global_epoch0_step{s}")        # freed by Lustre retention
    conf = tmp_path / "node.yaml"
    conf.write_text(dump(cfg))
    return cfg, conf, tmp_path, originals


@pytest.mark.timeout(300)
def test_archive_retention_keeps_a_checkpoint_a_restore_is_reading(only_in_archive) -> None:
    cfg, conf, tmp, originals = only_in_archive
    name = "global_epoch0_step1"
    flags = {k: str(tmp / k) for k in ("reading", "go")}
    # Retention evaluates first (the checkpoint is not on Lustre: a delete), then waits until the
    # restore has chosen it and is reading; only then does it act.
    ret = _start(RETENTION, conf=str(conf), name=name, wait_for=flags["reading"])
    time.sleep(0.5)
    rst = _start(RESTORE, conf=str(conf), name=name, **flags)
    _wait_for(Path(flags["reading"]), [ret, rst])
    got = _out(ret)                      # retention finished while the restore was mid-way
    assert got[name][0] == "keep" and "a restore of it" in str(got[name][1]), got
    assert got["global_epoch0_step2"][0] == "delete"
    Path(flags["go"]).touch()
    assert _out(rst) == {"ok": True, "source": "archive"}
    d = Path(cfg.root) / "m" / name
    assert commit.read_marker(d) is not None and (d / "a.bin").read_bytes() == originals[1]


@pytest.mark.timeout(300)
def test_a_restore_that_starts_while_archive_retention_deletes_the_checkpoint_stops_cleanly(only_in_archive) -> None:
    cfg, conf, tmp, _ = only_in_archive
    name = "global_epoch0_step1"
    flags = {k: str(tmp / k) for k in ("reading", "go", "journaled")}
    ret = _start(RETENTION, conf=str(conf), name=name, journaled=flags["journaled"], go=flags["go"])
    rst = _start(RESTORE, conf=str(conf), name=name, reading=flags["reading"], go=flags["go"],
                 after=flags["journaled"])
    r = _out(rst)
    assert r["ok"] is False and "archive retention started deleting" in r["error"], r
    assert not Path(flags["reading"]).exists()                       # it never started reading
    assert commit.read_marker(Path(cfg.root) / "m" / name) is None        # nothing looks restored
    Path(flags["go"]).touch()
    got = _out(ret)
    assert got[name][0] == "delete"
