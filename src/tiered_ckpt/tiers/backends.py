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
import posixpath
import re
import secrets
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, ClassVar, Protocol

from tiered_ckpt.config import NodeConfig
from tiered_ckpt.errors import ConfigError, IntegrityError, UnavailableError
from tiered_ckpt.io import fsafe
from tiered_ckpt.io.hashing import new_hasher
from tiered_ckpt.io.marker import FileEntry, Manifest
from tiered_ckpt.tiers import blob as blobstore
from tiered_ckpt.tiers.blob import BlobStore
from tiered_ckpt.tiers.hsm import HsmState, Lfs


class ImportJobs(Protocol):
    """What restore needs from arm.AmlfsJobs (the ARM client, tiers/arm.py)."""

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
    def prefetch(self, paths: Sequence[str], progress: Callable[[int], None] | None = None) -> list[str]:
        """Make released files resident again; returns the paths that needed it (their bytes came
        from the archive). `progress` gets the bytes of each file as it becomes resident."""

    @abstractmethod
    def rehydrate(self, manifest: Manifest, ckpt_dir: Path, progress: Callable[[int], None]) -> bool:
        """Bring the data files of a checkpoint that is only in the archive back onto the
        accelerator layer, each checked against the marker's hash (IntegrityError naming the
        file if the archive's copy differs). True when every file had a hash to check. The
        caller checks sizes and writes the marker last."""


# --------------------------------------------------------------------------------------------
# Restore helpers: every path under the root is opened through fsafe (anchor = the root), so a
# symlink planted anywhere in the checkpoint tree is refused, never followed.

_TEMP = re.compile(r"^\..+\.restoring$")


def ensure_dir(root: str | os.PathLike[str], path: str | os.PathLike[str]) -> int:
    """A descriptor of directory `path` under `root`, creating missing components (fsafe.DIR_MODE).

    No component below the root may be a symlink (fsafe.UnsafePath otherwise).
    """
    return fsafe.make_dirs(path, anchor=root)


def hash_fd(fd: int, chunk: int = 8 << 20) -> str:
    """xxh3-128 of a whole open file, read with pread (the descriptor's offset is untouched)."""
    h = new_hasher()
    off = 0
    while True:
        b = os.pread(fd, chunk, off)
        if not b:
            return h.hexdigest()
        h.update(b)
        off += len(b)


def hash_at(root: str | os.PathLike[str], path: str | os.PathLike[str]) -> str:
    """xxh3-128 of a regular file under the root (no symlink followed, a FIFO refused)."""
    fd = fsafe.open_file(path, anchor=root)
    try:
        return hash_fd(fd)
    finally:
        os.close(fd)


def archive_damaged(name: str, path: str | os.PathLike[str], got: str, want: str, against: str = "its marker") -> IntegrityError:
    return IntegrityError(
        f"checkpoint {name}: the archive's copy of {path} does not match {against} (xxh3-128 {got}, expected "
        f"{want}): the archive copy itself is damaged or was overwritten by a later save of this name. "
        "Nothing was restored under its final name and no marker was written, so it does not look committed; "
        "restoring again would fetch the same bytes — restore another checkpoint (`tiered-ckpt status` lists them)"
    )


def temp_name(final: str) -> str:
    """A dot-name (the exporter skips it) unique to this process and call."""
    return f".{final}.{os.getpid()}.{secrets.token_hex(6)}.restoring"


def clean_temps(dfd: int) -> None:
    """Remove leftover restore temp files of killed restores (the caller holds the checkpoint lock)."""
    for n in os.listdir(dfd):
        if _TEMP.match(n):
            try:
                os.unlink(n, dir_fd=dfd)      # a planted symlink is removed itself, never followed
            except (FileNotFoundError, IsADirectoryError, PermissionError):
                pass


class LocalBackend(TierBackend):
    kind = "local"

    def hsm_states(self, paths: Sequence[str]) -> None:
        return None

    def release(self, paths: Sequence[str]) -> None:
        raise ConfigError("retention action release needs backend amlfs (lfs hsm_release); use --action delete with the local back-end")

    def prefetch(self, paths: Sequence[str], progress: Callable[[int], None] | None = None) -> list[str]:
        return []

    def rehydrate(self, manifest: Manifest, ckpt_dir: Path, progress: Callable[[int], None]) -> bool:
        # Each file arrives in a temp file of this process (O_EXCL, a dot-name the local exporter
        # skips) and takes its final name only once every file is complete and matches the
        # marker's hash: the exporter uploads new and changed files, so a half-downloaded or
        # damaged file under its final name (restore still running, or killed) would overwrite
        # the good blob, the only copy left. (On AMLFS the import job pauses auto-export instead.)
        root = Path(self.cfg.root)
        base = self.rel(ckpt_dir)
        blobs = self.store.listing(base)
        dirs: dict[str, int] = {}
        temps: list[tuple[int, str, int, str]] = []     # (dir fd, temp name, fd, display path)
        renamed: set[str] = set()
        try:
            for f in manifest.files:
                parent = posixpath.dirname(f.path)
                if parent not in dirs:
                    dirs[parent] = ensure_dir(root, ckpt_dir / parent if parent else ckpt_dir)
                    clean_temps(dirs[parent])
            for f in manifest.files:
                dfd = dirs[posixpath.dirname(f.path)]
                tmp = temp_name(posixpath.basename(f.path))
                fd = fsafe.open_file(Path(tmp), os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644, dir_fd=dfd)
                temps.append((dfd, tmp, fd, str(ckpt_dir / posixpath.dirname(f.path) / tmp)))
            items = [(f"{base}/{f.path}", t[3]) for f, t in zip(manifest.files, temps, strict=True)]
            self.store.download_many(items, progress, fds={t[3]: t[2] for t in temps})

            def check(job: tuple[FileEntry, tuple[int, str, int, str]]) -> bool:
                f, (_, _, fd, _) = job
                b = blobs.get(f"{base}/{f.path}")
                size = os.fstat(fd).st_size
                if size != f.size:
                    raise IntegrityError(
                        f"checkpoint {manifest.name}: the archive's copy of {ckpt_dir / f.path} has {size} bytes, its "
                        f"marker says {f.size}: the archive changed during the restore; re-run restore")
                want, against = f.hash, "its marker"
                if want is None and b is not None and b.xxh3:
                    want, against = b.xxh3, "the hash the exporter recorded"   # saved without hashes
                if want is not None:
                    got = hash_fd(fd)
                    if got != want:
                        raise archive_damaged(manifest.name, ckpt_dir / f.path, got, want, against)
                os.fchmod(fd, 0o644)        # explicit: the process umask must not decide
                mtime = b.metadata.get(blobstore.META_MTIME) if b else None
                if mtime and mtime.isdigit():
                    # Give each file back the mtime it was exported with (like `rsync -t`), so the
                    # exporter does not see restored files as changed and upload them again.
                    os.utime(fd, ns=(int(mtime), int(mtime)))
                os.fsync(fd)
                return f.hash is not None

            with ThreadPoolExecutor(max(1, min(self.cfg.archive.concurrency, len(temps)))) as ex:
                hashed = list(ex.map(check, zip(manifest.files, temps, strict=True)))
            for f, (dfd, tmp, fd, _) in zip(manifest.files, temps, strict=True):
                final = posixpath.basename(f.path)
                # rename(2) replaces whatever entry has the final name (a planted symlink
                # included) without following it.
                os.rename(tmp, final, src_dir_fd=dfd, dst_dir_fd=dfd)
                renamed.add(tmp)
                st, now = os.fstat(fd), os.lstat(final, dir_fd=dfd)
                if (st.st_dev, st.st_ino) != (now.st_dev, now.st_ino):
                    raise IntegrityError(f"{ckpt_dir / f.path} was replaced while restore renamed it into place; re-run restore")
            for dfd in dirs.values():
                os.fsync(dfd)
            return all(hashed)
        finally:
            for dfd, tmp, fd, _ in temps:
                os.close(fd)
                if tmp not in renamed:
                    try:
                        os.unlink(tmp, dir_fd=dfd)
                    except FileNotFoundError:
                        pass
            for dfd in dirs.values():
                os.close(dfd)


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

    def prefetch(self, paths: Sequence[str], progress: Callable[[int], None] | None = None) -> list[str]:
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
        return released

    def rehydrate(self, manifest: Manifest, ckpt_dir: Path, progress: Callable[[int], None]) -> bool:
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
        # Every byte came from the archive: check each file against the marker (xxh3 reads far
        # faster than the import brings data). The caller removes the imported marker if not.
        root = self.cfg.root
        hashed = [f for f in manifest.files if f.hash is not None]

        def check(f: FileEntry) -> None:
            got = hash_at(root, ckpt_dir / f.path)
            if got != f.hash:
                raise archive_damaged(manifest.name, ckpt_dir / f.path, got, str(f.hash))

        with ThreadPoolExecutor(max(1, min(self.cfg.archive.concurrency, len(hashed) or 1))) as ex:
            list(ex.map(check, hashed))
        return len(hashed) == len(manifest.files)


def make_jobs(cfg: NodeConfig) -> ImportJobs:
    """The ARM client (azure-mgmt-storagecache, tiers/arm.py); ConfigError names any missing amlfs.* setting."""
    from tiered_ckpt.tiers import arm

    return arm.AmlfsJobs.from_config(cfg)


def make_backend(cfg: NodeConfig, store: BlobStore | None = None, **kw: Any) -> TierBackend:
    if cfg.backend == "local":
        return LocalBackend(cfg, store)
    return AmlfsBackend(cfg, store, **kw)


__all__ = ["AmlfsBackend", "LocalBackend", "TierBackend", "make_backend"]
