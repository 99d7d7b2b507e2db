"""The two tier back-ends behind one interface, chosen by `backend:` or --backend.

* AmlfsBackend: the accelerator layer is AMLFS. HSM state comes from `lfs hsm_state`
  (batched), release and prefetch from `lfs hsm_release` / `lfs hsm_restore`, and a deleted
  checkpoint comes back through an ARM import job (arm.AmlfsJobs). Blob is read too
  whenever the archive is configured, to double-check what lfs says.
* LocalBackend: the accelerator layer is a directory; Blob (Azurite or Azure) is filled by
  the local exporter. There is no HSM: files are resident or absent, and a deleted
  checkpoint is downloaded from Blob.
"""
from __future__ import annotations

import os
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, ClassVar, Protocol

from . import blobstore
from .blobstore import BlobStore
from .config import NodeConfig
from .errors import ConfigError, IntegrityError, UnavailableError
from .hsm import HsmState, Lfs
from .manifest import MARKER, Manifest, fsync_dir


class ImportJobs(Protocol):
    """What restore needs from arm.AmlfsJobs (helper C1's ARM client)."""

    def import_prefixes(self, prefixes: list[str], conflict_mode: str = ...) -> Any: ...

    def autoexport_status(self) -> Any: ...


class TierBackend(ABC):
    kind: ClassVar[str]

    def __init__(self, cfg: NodeConfig, store: BlobStore | None = None) -> None:
        self.cfg = cfg
        self._store = store

    @property
    def archive_configured(self) -> bool:
        return self._store is not None or blobstore.configured(self.cfg.archive)

    @property
    def store(self) -> BlobStore:
        if self._store is None:
            self._store = BlobStore(self.cfg.archive)
        return self._store

    def rel(self, path: str | Path) -> str:
        """A path on the accelerator layer relative to the checkpoint root ('/'-separated)."""
        p = str(path)
        base = str(self.cfg.root).rstrip("/") + "/"
        if p.startswith(base):        # string slicing: this runs once per file of every proof
            return p[len(base):]
        return Path(path).relative_to(self.cfg.root).as_posix()

    @abstractmethod
    def hsm_states(self, paths: Sequence[str]) -> tuple[dict[str, HsmState], dict[str, str]] | None:
        """HSM state per path (and per-path errors); None where the tier has no HSM."""

    @abstractmethod
    def release(self, paths: Sequence[str]) -> None:
        """Free the data of archived files but keep their names (AMLFS only)."""

    @abstractmethod
    def prefetch(self, paths: Sequence[str], progress: Callable[[int], None] | None = None) -> int:
        """Make released files resident again; returns how many needed it. `progress` gets the
        bytes of each file as it becomes resident."""

    @abstractmethod
    def rehydrate(self, manifest: Manifest, ckpt_dir: Path, progress: Callable[[int], None]) -> None:
        """Bring the data files of a checkpoint that is only in the archive back onto the
        accelerator layer. The caller verifies and writes the marker last."""


class LocalBackend(TierBackend):
    kind = "local"

    def hsm_states(self, paths: Sequence[str]) -> None:
        return None

    def release(self, paths: Sequence[str]) -> None:
        raise ConfigError("retention action release needs backend amlfs (lfs hsm_release); use --action delete with the local back-end")

    def prefetch(self, paths: Sequence[str], progress: Callable[[int], None] | None = None) -> int:
        return 0

    def rehydrate(self, manifest: Manifest, ckpt_dir: Path, progress: Callable[[int], None]) -> None:
        # Each file arrives under a dot-name the local exporter skips, and takes its final name
        # only when complete: the exporter uploads new and changed files, so a half-downloaded
        # file under its final name (restore still running, or killed) would overwrite the good
        # blob, the only copy left. (On AMLFS the import job pauses auto-export instead.)
        base = self.rel(ckpt_dir)
        final = [ckpt_dir / f.path for f in manifest.files]
        parts = [p.with_name(f".{p.name}.restoring") for p in final]
        items = [(f"{base}/{f.path}", str(part)) for f, part in zip(manifest.files, parts, strict=True)]
        try:
            self.store.download_many(items, progress)
            # Give each file back the mtime it was exported with (like `rsync -t`), so the
            # exporter does not see restored files as changed and upload them again.
            blobs = self.store.listing(base)
            for (rel, _), part, dest in zip(items, parts, final, strict=True):
                b = blobs.get(rel)
                mtime = b.metadata.get(blobstore.META_MTIME) if b else None
                if b is not None and mtime and mtime.isdigit() and part.stat().st_size == b.size:
                    os.utime(part, ns=(int(mtime), int(mtime)))
                os.replace(part, dest)
        finally:
            for part in parts:
                part.unlink(missing_ok=True)
        for d in {p.parent for p in final}:
            fsync_dir(d)


class AmlfsBackend(TierBackend):
    kind = "amlfs"

    def __init__(self, cfg: NodeConfig, store: BlobStore | None = None, *, lfs: Lfs | None = None,
                 jobs: ImportJobs | None = None, restore_timeout: float = 3600.0, poll: float = 1.0) -> None:
        super().__init__(cfg, store)
        self.lfs = lfs or Lfs(cfg.amlfs.lfs, cfg.amlfs.hsm_batch)
        self._jobs = jobs
        self.restore_timeout = restore_timeout
        self.poll = poll

    @property
    def jobs(self) -> ImportJobs:
        if self._jobs is None:
            self._jobs = make_jobs(self.cfg)
        return self._jobs

    def hsm_states(self, paths: Sequence[str]) -> tuple[dict[str, HsmState], dict[str, str]]:
        return self.lfs.states(paths)

    def release(self, paths: Sequence[str]) -> None:
        self.lfs.release(paths)

    def prefetch(self, paths: Sequence[str], progress: Callable[[int], None] | None = None) -> int:
        states, errors = self.lfs.states(paths)
        if errors:
            p, e = next(iter(errors.items()))
            raise IntegrityError(f"cannot read the HSM state of {p}: {e}")
        released = [p for p in paths if states[p].released]
        if released:
            def resident(done: list[str]) -> None:
                if progress is not None:
                    progress(sum(os.path.getsize(p) for p in done))

            self.lfs.restore(released)
            self.lfs.wait_resident(released, self.restore_timeout, self.poll, resident)
        return len(released)

    def rehydrate(self, manifest: Manifest, ckpt_dir: Path, progress: Callable[[int], None]) -> None:
        # AMLFS maps blob <p> to /lustrefs/<p>: the import prefix is the checkpoint's blob
        # prefix as a path. The trailing '/' keeps step10 from matching step100.
        prefix = "/" + blobstore.blob_name(self.cfg.archive.prefix, self.rel(ckpt_dir)) + "/"
        result = self.jobs.import_prefixes([prefix], conflict_mode="OverwriteIfDirty")
        state = str(getattr(result, "state", "Completed") or "Completed")
        if state not in ("Completed", "Succeeded"):
            raise UnavailableError(
                f"the AMLFS import job for {prefix} ended {state}"
                f"{': ' + str(getattr(result, 'message', '')) if getattr(result, 'message', None) else ''}; "
                "auto-export was re-enabled; check the job in the portal (Blob integration) and re-run restore"
            )
        paths = [str(ckpt_dir / f.path) for f in manifest.files]
        # Imported files can take a moment to show up in the namespace.
        deadline = time.monotonic() + self.restore_timeout
        while True:
            missing = [p for p in paths if not Path(p).exists()]
            if not missing:
                break
            if time.monotonic() > deadline:
                raise UnavailableError(f"{len(missing)} files of {manifest.name} did not appear after the import (first: {missing[0]})")
            time.sleep(self.poll)
        self.prefetch(paths, progress)


def make_jobs(cfg: NodeConfig) -> ImportJobs:
    """helper C1's ARM client (azure-mgmt-storagecache); ConfigError names any missing amlfs.* setting."""
    from . import arm

    return arm.AmlfsJobs.from_config(cfg)


def make_backend(cfg: NodeConfig, store: BlobStore | None = None, **kw: Any) -> TierBackend:
    if cfg.backend == "local":
        return LocalBackend(cfg, store)
    return AmlfsBackend(cfg, store, **kw)


__all__ = ["MARKER", "AmlfsBackend", "LocalBackend", "TierBackend", "make_backend"]
