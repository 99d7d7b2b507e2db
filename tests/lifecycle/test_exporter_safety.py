"""The local exporter and the archive side against hostile files, on a real Azurite.

* a file swapped for a symlink between discovery and upload is never uploaded (failed);
* a directory it cannot read and a name that is not UTF-8 are failed files, not a dead
  exporter or "0 failed", and the other files still go;
* a marker in Blob that is not valid (``"created_utc": 5``) is never chosen by
  ``restore --latest`` and breaks neither ``status`` nor ``retention plan``.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from azure.storage.blob import ContainerClient

from tests.lifecycle.helpers import local_cfg, make_checkpoint
from tiered_ckpt.config import dump
from tiered_ckpt.io import commit
from tiered_ckpt.lifecycle.exporter import Exporter
from tiered_ckpt.tiers.blob import BlobStore

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def env(tmp_path: Path, azurite_container: tuple[str, str]):
    conn, container = azurite_container
    root = tmp_path / "lustre"
    root.mkdir()
    cfg = local_cfg(root, conn, container, keep_last=1, min_keep=1)
    store = BlobStore(cfg.archive, backoff=0.01)
    conf = tmp_path / "config.yaml"
    conf.write_text(dump(cfg))
    return cfg, store, ContainerClient.from_connection_string(conn, container), conf


def blob_names(cc: ContainerClient) -> set[str]:
    return {b.name for b in cc.list_blobs()}


def cli_json(conf: Path, *argv: str, prefix: tuple[str, ...] = ()) -> tuple[int, Any]:
    p = subprocess.run([*prefix, sys.executable, "-m", "tiered_ckpt", *argv, "--config", str(conf), "--json"],
                       capture_output=True, text=True, timeout=60)
    assert "Traceback" not in p.stderr, p.stderr
    return p.returncode, json.loads(p.stdout)


def test_a_file_swapped_for_a_symlink_after_discovery_is_never_uploaded(env, tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    cfg, store, cc, _ = env
    d = make_checkpoint(cfg.root, "m", 0, 10, files={"a.bin": b"A" * 4096, "b.bin": b"B" * 4096})
    secret = tmp_path / "node.key"
    secret.write_bytes(b"K" * 4096)               # same size: only the file's identity can tell
    secret.chmod(0o600)
    ex = Exporter(cfg, store, status_path=tmp_path / "st.json")
    real = ex.discover

    def discover_then_swap():
        todo = real()                              # a.bin was lstat'ed as a regular file...
        (d / "a.bin").unlink()
        (d / "a.bin").symlink_to(secret)           # ...and is a symlink to a secret by the upload
        return todo

    monkeypatch.setattr(ex, "discover", discover_then_swap)
    it = ex.iterate()
    assert not it.ok and it.files_failed == 1
    assert "m/global_epoch0_step10/a.bin" in it.errors[0] and "symbolic link" in it.errors[0]
    assert "checkpoints/m/global_epoch0_step10/a.bin" not in blob_names(cc)
    assert cc.download_blob("checkpoints/m/global_epoch0_step10/b.bin").readall() == b"B" * 4096
    assert all(b"K" * 64 not in cc.download_blob(n).readall() for n in blob_names(cc))


def test_a_file_replaced_by_another_after_discovery_waits_for_the_next_iteration(env, tmp_path: Path,
                                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    cfg, store, cc, _ = env
    d = make_checkpoint(cfg.root, "m", 0, 10, files={"a.bin": b"old!" * 1024})
    ex = Exporter(cfg, store, status_path=tmp_path / "st.json")
    real = ex.discover

    def discover_then_replace():
        todo = real()
        tmp = d / ".a.bin.new"
        tmp.write_bytes(b"new!" * 1024)
        os.replace(tmp, d / "a.bin")              # another inode under the discovered name
        return todo

    monkeypatch.setattr(ex, "discover", discover_then_replace)
    it = ex.iterate()
    assert it.ok and "m/global_epoch0_step10/a.bin" not in it.exported
    monkeypatch.undo()
    it = ex.iterate()
    assert it.ok and "m/global_epoch0_step10/a.bin" in it.exported
    assert cc.download_blob("checkpoints/m/global_epoch0_step10/a.bin").readall() == b"new!" * 1024


def test_unreadable_directory_and_non_utf8_name_are_failed_files_and_the_rest_is_exported(env, tmp_path: Path) -> None:
    cfg, _, cc, conf = env
    make_checkpoint(cfg.root, "m", 0, 10, files={"a.bin": b"a" * 100})
    locked = make_checkpoint(cfg.root, "m", 0, 20, files={"b.bin": b"b" * 100}, commit=False)
    bad = os.path.join(os.fsencode(cfg.root), b"m", b"global_epoch0_step10", b"bad\xff.bin")
    with open(bad, "wb") as f:
        f.write(b"x")
    locked.chmod(0)
    # As root, mode 000 does not stop a read: run the exporter without the capabilities that
    # bypass file permissions (capabilities(7): CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH).
    prefix: tuple[str, ...] = ()
    if os.geteuid() == 0:
        setpriv = shutil.which("setpriv")
        if setpriv is None:
            pytest.skip("running as root and setpriv(1) is not installed: cannot make a directory unreadable")
        prefix = (setpriv, "--inh-caps=-all", "--bounding-set=-dac_override,-dac_read_search")
    try:
        rc, out = cli_json(conf, "export", "--once", "--export-status", str(tmp_path / "st.json"), prefix=prefix)
    finally:
        locked.chmod(0o755)
    assert rc == 1 and not out["ok"] and out["files_failed"] == 2, out
    errors = " | ".join(out["errors"])
    assert "global_epoch0_step20: cannot read the directory (Permission denied)" in errors
    assert "bad\\xff.bin: the name is not valid UTF-8" in errors
    assert "checkpoints/m/global_epoch0_step10/a.bin" in blob_names(cc)
    st = json.loads((tmp_path / "st.json").read_text())
    assert st["state"] == "Failed" and st["total_files_failed"] == 2
    rc, out = cli_json(conf, "status", "--export-status", str(tmp_path / "st.json"))
    # A failed export iteration is a problem status reports (exit 1), not a healthy state.
    assert rc == 1 and out["export"]["state"] == "Failed"
    assert {c["part"]: c["state"] for c in out["checks"]}["export"] == "PROBLEM"


def test_an_invalid_marker_in_blob_is_never_restored_nor_breaks_status_or_retention(env, tmp_path: Path) -> None:
    cfg, store, cc, conf = env
    make_checkpoint(cfg.root, "m", 0, 10)
    newer = make_checkpoint(cfg.root, "m", 0, 20)
    Exporter(cfg, store, status_path=tmp_path / "st.json").iterate()
    marker = "checkpoints/m/global_epoch0_step20/COMMITTED.json"
    m = json.loads(cc.download_blob(marker).readall())
    m["created_utc"] = 5
    cc.upload_blob(marker, json.dumps(m).encode(), overwrite=True)
    commit.remove_checkpoint(newer)                 # now only the archive holds step20, with a bad marker

    rc, out = cli_json(conf, "restore", "--latest")
    assert rc == 0 and out["name"] == "global_epoch0_step10" and out["source"] == "resident", out
    rc, out = cli_json(conf, "status", "--export-status", str(tmp_path / "st.json"))
    assert rc == 0 and "global_epoch0_step20" not in {c["name"] for c in out["checkpoints"]}, out
    rc, out = cli_json(conf, "retention", "plan")
    assert rc == 0 and [c["name"] for c in out["checkpoints"]] == ["global_epoch0_step10"], out

    commit.remove_checkpoint(Path(cfg.root) / "m" / "global_epoch0_step10")   # wiped: the archive is all there is
    rc, out = cli_json(conf, "restore", "--latest")
    assert rc == 0 and out["name"] == "global_epoch0_step10" and out["source"] == "archive", out
    assert not (Path(cfg.root) / "m" / "global_epoch0_step20").exists()
