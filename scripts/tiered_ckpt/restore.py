"""Restore (rehydrate): make a committed checkpoint readable on the accelerator layer.

The newest committed checkpoint is found by scanning markers on both tiers (no "latest"
pointer). A checkpoint is committed in Blob when its COMMITTED.json blob parses and every
file it names has a blob of the right size. The cheapest path wins:

* resident: nothing to do;
* released (AMLFS): batched `lfs hsm_restore`, then wait until resident;
* only in the archive: AMLFS import job for the checkpoint's prefix (arm.AmlfsJobs disables
  auto-export, imports, re-enables it, always), or, locally, a parallel download from Blob.

Sizes are always verified, hashes with --verify. The marker is written LAST
(manifest.write_marker): an interrupted or failed restore leaves a directory without a marker,
which no scan ever takes as complete. Locally each file is downloaded under a dot-name and
takes its final name when complete, so the local exporter never uploads a partial file over
the archived one (backends.LocalBackend.rehydrate).
"""
from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from . import manifest as mf
from .backends import TierBackend
from .blobstore import BlobInfo, BlobStore, archived_markers
from .config import NodeConfig
from .errors import IntegrityError, UnavailableError, UserError
from .hashing import hash_path
from .journal import forget
from .naming import require_name
from .output import byte_progress
from .writer import os_error


@dataclass(frozen=True)
class Found:
    manifest: mf.Manifest
    where: str                # "accelerator" (committed on Lustre/local dir) or "archive"


@dataclass
class RestoreResult:
    name: str
    path: str
    source: str               # resident | released | archive
    bytes: int
    seconds: float
    verified: bool
    files: int
    prefetched_files: int = 0
    warnings: list[str] = field(default_factory=list)

    @property
    def gbps(self) -> float:
        return self.bytes / self.seconds / 1e9 if self.seconds > 0 else 0.0

    def to_json(self) -> dict[str, Any]:
        return {"ok": True, "name": self.name, "path": self.path, "source": self.source, "bytes": self.bytes,
                "seconds": round(self.seconds, 3), "gb_per_s": round(self.gbps, 3), "verified": self.verified,
                "files": self.files, "prefetched_files": self.prefetched_files, "warnings": self.warnings}


def archive_committed(store: BlobStore, model: str, listing: Mapping[str, BlobInfo] | None = None) -> list[mf.Manifest]:
    """Checkpoints committed in Blob: marker parses, names itself, every file present with its size.

    `listing`: the model's blobs when the caller has listed them already (status).
    """
    blobs = store.listing(model) if listing is None else listing
    out = []
    for marker in archived_markers(store, blobs):
        m = marker.manifest
        if m is None:
            continue
        base = f"{model}/{m.name}/"
        if all((b := blobs.get(base + f.path)) is not None and b.size == f.size for f in m.files):
            out.append(m)
    return sorted(out, key=lambda m: m.id)


def committed_anywhere(cfg: NodeConfig, backend: TierBackend, warnings: list[str] | None = None) -> dict[str, Found]:
    """Committed checkpoints by name; the accelerator layer wins where both have one.

    If the archive cannot be reached but the accelerator layer has committed checkpoints,
    those are used and a warning is added (a training restart should not wait for Blob);
    with nothing local the UnavailableError stands.
    """
    found: dict[str, Found] = {}
    unreachable: UnavailableError | None = None
    if backend.archive_configured:
        try:
            for m in archive_committed(backend.store, cfg.model):
                found[m.name] = Found(m, "archive")
        except UnavailableError as e:
            unreachable = e
    for c in mf.committed(mf.scan(cfg.root, cfg.model)):
        assert c.manifest is not None
        found[c.name] = Found(c.manifest, "accelerator")
    if unreachable is not None:
        if not found:
            raise unreachable
        if warnings is not None:
            warnings.append(f"archive not consulted, only the accelerator layer: {unreachable}")
    return found


def choose(cfg: NodeConfig, backend: TierBackend, name: str | None, warnings: list[str] | None = None) -> Found:
    found = committed_anywhere(cfg, backend, warnings)
    if name is not None:
        require_name(name)
        if name not in found:
            raise UserError(
                f"checkpoint {name} of model {cfg.model!r} is not committed on the accelerator layer ({cfg.root}) "
                f"nor in the archive; `tiered-ckpt status` lists what exists",
                exit_code=1,
            )
        return found[name]
    if not found:
        raise UserError(
            f"no committed checkpoint of model {cfg.model!r} under {cfg.root} or in the archive; nothing to restore",
            exit_code=1,
        )
    return found[max(found, key=lambda n: found[n].manifest.id)]


def verify_hashes(ckpt_dir: Path, m: mf.Manifest, workers: int = 4) -> None:
    def check(f: mf.FileEntry) -> str | None:
        if f.hash is None:
            return None
        got = hash_path(str(ckpt_dir / f.path))
        return None if got == f.hash else f"{ckpt_dir / f.path}: xxh3-128 {got}, manifest says {f.hash}"

    with ThreadPoolExecutor(max(1, workers)) as ex:
        bad = [p for p in ex.map(check, m.files) if p]
    if bad:
        raise IntegrityError(
            f"checkpoint {m.name} failed hash verification: {bad[0]}"
            + (f" (and {len(bad) - 1} more)" if len(bad) > 1 else "")
            + "; the file differs from what was committed — do not train from it; restore it again from the archive"
        )


def restore(cfg: NodeConfig, backend: TierBackend, name: str | None = None, *, verify: bool = False,
            progress: bool = True, on_bytes: Callable[[int], None] | None = None) -> RestoreResult:
    """Make checkpoint `name` (or the newest committed anywhere) readable; see the module doc."""
    root = Path(cfg.root)
    if cfg.backend == "amlfs":
        # Never create the root: with AMLFS not mounted, that would restore onto the OS disk.
        mf.require_root(root)
    else:
        root.mkdir(parents=True, exist_ok=True)   # local mode: the directory is the accelerator layer
    warnings: list[str] = []
    target = choose(cfg, backend, name, warnings)
    m = target.manifest
    ckpt_dir = mf.model_dir(root, cfg.model) / m.name
    t0 = time.monotonic()

    if target.where == "accelerator":
        paths = [str(ckpt_dir / f.path) for f in m.files]
        with byte_progress(f"hsm_restore {m.name}", m.total_bytes, enabled=progress and backend.kind == "amlfs") as bar:
            prefetched = backend.prefetch(paths, bar.advance)
        problems = mf.size_problems(ckpt_dir, m)
        if problems:
            raise IntegrityError(f"checkpoint {m.name}: {problems[0]}")
        if verify:
            verify_hashes(ckpt_dir, m, cfg.archive.concurrency)
        return RestoreResult(m.name, str(ckpt_dir), "released" if prefetched else "resident", m.total_bytes,
                             time.monotonic() - t0, verify, len(m.files), prefetched, warnings)

    # Only in the archive. A marker left here is stale (the directory is not committed):
    # remove it before any data arrives so the directory never looks complete too early.
    # A journal entry left by a killed retention run would let the next run take this
    # directory, still without its marker, for an interrupted delete: drop it first.
    forget(root, cfg.model, m.name)
    ckpt_dir.mkdir(parents=True, exist_ok=True)
    stale = ckpt_dir / mf.MARKER
    if stale.exists():
        stale.unlink()
        mf.fsync_dir(ckpt_dir)
    with byte_progress(f"restore {m.name}", m.total_bytes, enabled=progress) as bar:
        def advance(n: int) -> None:
            bar.advance(n)
            if on_bytes is not None:
                on_bytes(n)

        try:
            backend.rehydrate(m, ckpt_dir, advance)
        except OSError as e:
            # The local side of a download (ENOSPC, EACCES, ...): the blob store only turns the
            # archive's own errors into UserErrors. No marker yet, so nothing looks restored.
            raise os_error(e, e.filename or ckpt_dir) from None
    problems = mf.size_problems(ckpt_dir, m)
    if problems:
        raise IntegrityError(f"restored checkpoint {m.name} is incomplete: {problems[0]}; re-run restore")
    if verify:
        verify_hashes(ckpt_dir, m, cfg.archive.concurrency)
    if mf.read_marker(ckpt_dir) is None:      # AMLFS imports bring the marker themselves
        try:
            mf.write_marker(ckpt_dir, m)
        except OSError as e:
            raise os_error(e, ckpt_dir / mf.MARKER) from None
    return RestoreResult(m.name, str(ckpt_dir), "archive", m.total_bytes, time.monotonic() - t0, verify, len(m.files))
