"""Shared helpers for the lifecycle tests: committed checkpoints without the writer, configs,
the fake lfs environment."""
from __future__ import annotations

import os
import subprocess
from pathlib import Path
from typing import Any

from tiered_ckpt.config import AmlfsConfig, ArchiveConfig, NodeConfig, RetentionConfig
from tiered_ckpt.io.commit import write_marker
from tiered_ckpt.io.hashing import new_hasher
from tiered_ckpt.io.marker import FileEntry, Manifest
from tiered_ckpt.tiers.backends import AmlfsBackend
from tiered_ckpt.tiers.blob import BlobStore

REPO = Path(__file__).resolve().parents[2]
FAKE_LFS = REPO / "tests" / "doubles" / "bin" / "lfs"


def make_checkpoint(root: str | os.PathLike[str], model: str, epoch: int, step: int,
                    files: dict[str, bytes] | None = None, *, commit: bool = True,
                    created_utc: str | None = None) -> Path:
    """Write data files under their final names, then (if commit) the marker, as the writer does."""
    files = files if files is not None else {"rank0_shard0.bin": os.urandom(1000 + step % 97), "rank0_shard1.bin": os.urandom(500)}
    d = Path(root) / model / f"global_epoch{epoch}_step{step}"
    d.mkdir(parents=True, exist_ok=True)
    entries = []
    for rel, data in files.items():
        p = d / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(data)
        h = new_hasher()
        h.update(data)
        entries.append(FileEntry(rel, len(data), h.hexdigest()))
    if commit:
        m = Manifest(epoch=epoch, step=step, files=entries)
        if created_utc:
            m.created_utc = created_utc
        write_marker(d, m)
    return d


def local_cfg(root: Path, conn: str, container: str, **retention: Any) -> NodeConfig:
    return NodeConfig(
        root=str(root), model="m", backend="local",
        archive=ArchiveConfig(connection_string=conn, container=container, prefix="checkpoints", retries=1, concurrency=4),
        retention=RetentionConfig(**retention) if retention else RetentionConfig(),
    )


def amlfs_cfg(root: Path, conn: str | None = None, container: str = "c", batch: int = 2000, **retention: Any) -> NodeConfig:
    return NodeConfig(
        root=str(root), model="m", backend="amlfs",
        archive=ArchiveConfig(connection_string=conn, container=container, prefix="checkpoints", retries=1, concurrency=4),
        amlfs=AmlfsConfig(lfs=str(FAKE_LFS), hsm_batch=batch),
        retention=RetentionConfig(**retention) if retention else RetentionConfig(),
    )


def lfs_calls(count_file: Path, command: str | None = None) -> int:
    if not count_file.exists():
        return 0
    lines = count_file.read_text().splitlines()
    return sum(1 for line in lines if command is None or line.split()[1] == command)


def auto_export(root: str, store: BlobStore | None) -> None:
    """What AMLFS auto-export does for files under root: copy to Blob, then mark archived."""
    paths = [str(p) for p in Path(root).rglob("*") if p.is_file() and not any(x.startswith(".") for x in p.relative_to(root).parts)]
    if store is not None:
        for p in paths:
            store.upload_file(p, Path(p).relative_to(root).as_posix())
    subprocess.run([str(FAKE_LFS), "hsm_archive", *paths], check=True)


def backend_of(cfg, store, **kw) -> AmlfsBackend:
    return AmlfsBackend(cfg, store, poll=0.01, **kw)


def import_hook(cfg, store: BlobStore):
    """What an AMLFS import does: blobs under the prefix appear on Lustre as released stubs."""

    def hook(prefixes: list[str], mode: str):
        n = 0
        for prefix in prefixes:
            rel_prefix = prefix.strip("/")[len(cfg.archive.prefix) + 1:]
            for rel in store.listing(rel_prefix):
                dest = Path(cfg.root) / rel
                if not dest.exists():
                    store.download_file(rel, str(dest))
                    subprocess.run([str(FAKE_LFS), "hsm_archive", str(dest)], check=True)
                    subprocess.run([str(FAKE_LFS), "hsm_release", str(dest)], check=True)
                n += 1
        return n, n, 0

    return hook
