"""The archive going away mid-proof and mid-restore (a private Azurite, stopped on purpose)."""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from azure.storage.blob import BlobServiceClient

from tests.lifecycle.helpers import local_cfg, make_checkpoint
from tiered_ckpt.errors import UnavailableError
from tiered_ckpt.io import commit
from tiered_ckpt.io.marker import MARKER
from tiered_ckpt.lifecycle import retention as ret
from tiered_ckpt.lifecycle.exporter import Exporter
from tiered_ckpt.lifecycle.restore import restore
from tiered_ckpt.tiers.backends import LocalBackend
from tiered_ckpt.tiers.blob import BlobStore
from tiered_demo.azurite import Azurite


@pytest.fixture
def private_azurite():
    server = Azurite().start()
    try:
        BlobServiceClient.from_connection_string(server.connection_string).create_container("ckpts")
        yield server
    finally:
        server.cleanup()


def test_archive_unreachable_mid_proof_deletes_nothing(private_azurite: Azurite, tmp_path: Path) -> None:
    cfg = local_cfg(tmp_path / "root", private_azurite.connection_string, "ckpts", keep_last=1, min_keep=1)
    for s in (10, 20, 30):
        make_checkpoint(cfg.root, "m", 0, s)
    store = BlobStore(cfg.archive, backoff=0.01)
    Exporter(cfg, store, status_path=tmp_path / "st.json").iterate()
    private_azurite.stop()
    with pytest.raises(UnavailableError, match="unreachable.*failed 2 times.*nothing was deleted"):
        ret.apply(cfg, LocalBackend(cfg, store), ret.Policy(keep_last=1, min_keep=1))
    assert [c.name for c in commit.committed(commit.scan(cfg.root, "m"))] == [
        "global_epoch0_step10", "global_epoch0_step20", "global_epoch0_step30"]


def test_archive_unreachable_mid_restore_leaves_nothing_that_looks_complete(private_azurite: Azurite, tmp_path: Path) -> None:
    cfg = local_cfg(tmp_path / "root", private_azurite.connection_string, "ckpts")
    files = {f"shard{i}.bin": bytes([i]) * 300_000 for i in range(8)}
    make_checkpoint(cfg.root, "m", 0, 10, files=files)
    store = BlobStore(cfg.archive, backoff=0.01)
    Exporter(cfg, store, status_path=tmp_path / "st.json").iterate()
    shutil.rmtree(cfg.root)
    seen = [0]

    def stop_after_first_bytes(what: str, done: int, total: int) -> None:
        seen[0] = done
        if private_azurite.proc is not None:
            private_azurite.stop()                 # the archive disappears while data is arriving

    with pytest.raises(UnavailableError, match="unreachable"):
        restore(cfg, LocalBackend(cfg, store), None, progress=stop_after_first_bytes)
    assert seen[0] > 0
    d = Path(cfg.root) / "m" / "global_epoch0_step10"
    assert not (d / MARKER).exists()
    assert commit.latest_committed(cfg.root, "m") is None


def test_restart_uses_the_resident_newest_when_the_archive_is_down(private_azurite: Azurite, tmp_path: Path) -> None:
    cfg = local_cfg(tmp_path / "root", private_azurite.connection_string, "ckpts")
    make_checkpoint(cfg.root, "m", 0, 10)
    private_azurite.stop()
    r = restore(cfg, LocalBackend(cfg, BlobStore(cfg.archive, backoff=0.01)), None)
    assert (r.name, r.source) == ("global_epoch0_step10", "resident") and "archive not consulted" in r.warnings[0]
    shutil.rmtree(cfg.root)
    with pytest.raises(UnavailableError):
        restore(cfg, LocalBackend(cfg, BlobStore(cfg.archive, backoff=0.01)), None)
