"""Fixtures of the lifecycle tests: the fake lfs environment and a store with fast retries."""
from __future__ import annotations

from pathlib import Path

import pytest
from azure.storage.blob import ContainerClient

from tests.lifecycle.helpers import amlfs_cfg, local_cfg
from tiered_ckpt.tiers.blob import BlobStore


@pytest.fixture
def fake_lfs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Point the fake lfs at a fresh state file; returns the process-counter file."""
    state = tmp_path / "lfs-state.json"
    count = tmp_path / "lfs-count.txt"
    monkeypatch.setenv("FAKE_LFS_STATE", str(state))
    monkeypatch.setenv("FAKE_LFS_COUNT", str(count))
    monkeypatch.delenv("FAKE_LFS_DEFAULT_FLAGS", raising=False)
    monkeypatch.delenv("FAKE_LFS_COST", raising=False)
    return count


@pytest.fixture
def aml(tmp_path: Path, azurite_container: tuple[str, str], fake_lfs: Path):
    conn, container = azurite_container
    root = tmp_path / "lustrefs" / "checkpoints"
    root.mkdir(parents=True)
    cfg = amlfs_cfg(root, conn, container, batch=4, keep_last=1, min_keep=1)
    store = BlobStore(cfg.archive, backoff=0.01)
    return cfg, store, ContainerClient.from_connection_string(conn, container), fake_lfs


@pytest.fixture
def local_env(tmp_path: Path, azurite_container: tuple[str, str]):
    """(config, store, container client) of the local back-end over a fresh root and container,
    retention keeping one checkpoint."""
    conn, container = azurite_container
    root = tmp_path / "lustre"
    root.mkdir()
    cfg = local_cfg(root, conn, container, keep_last=1, min_keep=1)
    return cfg, BlobStore(cfg.archive, backoff=0.01), ContainerClient.from_connection_string(conn, container)
