"""The local exporter: the local-mode STAND-IN for AMLFS auto-export (not used on AMLFS).

Same semantics as the AMLFS auto-export job, so that everything above it (archive proof,
retention, restore) behaves the same in local mode:

* it copies new and changed files under the checkpoint root to the container, under the
  same relative path (blob = archive.prefix + "/" + path relative to the root),
  committed or not, in iterations;
* it never deletes a blob (deletes and renames on the accelerator layer are not propagated);
* each iteration records files discovered / exported / failed and the completion time of
  the last successful iteration, like the job's status in ARM.

Change detection uses the size and mtime the exporter stored in each blob's metadata (no
state outside Blob to lose). A file still being written is uploaded as it was when stat'ed;
its size or mtime then changes, so a later iteration uploads it again. The xxh3-128 of the
bytes actually sent is stored as metadata after the upload: a blob without it (crash between
the two calls) is exported again and never counts as proof.

Names starting with '.' under the root (the toolkit's lock and journal) are not exported.

The tree is shared, so the exporter trusts nothing in it: discovery is by lstat (a symlink is
not a regular file), the upload reads from a descriptor opened through fsafe (no symlink
followed below the root, never a FIFO) and only if that descriptor is the very file that was
discovered (same device, inode and size): a file swapped for a symlink between the two is
never uploaded, and is reported as failed. A directory it cannot read and a name that is not
UTF-8 (a Blob name must be) are reported as failed files too; the iteration goes on.
"""
from __future__ import annotations

import json
import logging
import os
import stat
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from tiered_ckpt.config import NodeConfig
from tiered_ckpt.errors import UserError
from tiered_ckpt.io import fsafe
from tiered_ckpt.logs import fields
from tiered_ckpt.redact import redact
from tiered_ckpt.tiers.backends import hash_fd
from tiered_ckpt.tiers.blob import META_HASH, META_MTIME, META_SIZE, BlobInfo, BlobStore

log = logging.getLogger(__name__)


def _now() -> str:
    return datetime.now(timezone.utc).isoformat()


@dataclass
class Iteration:
    started_utc: str
    completed_utc: str = ""
    files_discovered: int = 0       # new or changed since the last export
    files_exported: int = 0
    files_failed: int = 0
    bytes_exported: int = 0
    seconds: float = 0.0
    errors: list[str] = field(default_factory=list)
    exported: list[str] = field(default_factory=list)   # relative paths, for timelines

    @property
    def ok(self) -> bool:
        return self.files_failed == 0


@dataclass
class ExportStatus:
    """Shaped like the AMLFS auto-export job's status (arm.AutoExportStatus)."""

    admin_status: str = "Enable"
    state: str = "InProgress"              # InProgress | Failed (last iteration failed) | Disabled
    iterations: int = 0
    last_successful_iteration_utc: str | None = None
    total_files_failed: int = 0
    last_iteration: dict[str, Any] | None = None
    stand_in: str = "local exporter (stand-in for AMLFS auto-export)"


def shown(path: str | os.PathLike[str]) -> str:
    """A path for messages and JSON: bytes that are not UTF-8 shown as \\xNN escapes (a str
    holding the surrogates os.fsdecode makes of them cannot even be printed)."""
    return os.fsencode(path).decode("utf-8", "backslashreplace")


def _utf8(name: str) -> bool:
    try:
        name.encode("utf-8")
        return True
    except UnicodeEncodeError:
        return False


def walk_tree(top: Path) -> tuple[dict[str, os.stat_result], list[str]]:
    """Every regular file under `top` (path relative to it -> lstat), dot-names skipped: what
    an export iteration considers (the toolkit's lock and journal start with '.'); and what
    could not be considered, one line each (unreadable directories, names that are not UTF-8)."""
    out: dict[str, os.stat_result] = {}
    failed: list[str] = []
    if not top.is_dir():
        return out, failed

    def unreadable(e: OSError) -> None:
        where = shown(e.filename) if e.filename is not None else shown(top)
        failed.append(f"{where}: cannot read the directory ({e.strerror or e}); its files are not exported")

    def exportable(dirpath: str, names: list[str], what: str) -> list[str]:
        """The names an iteration considers: dot-names skipped, names that are not UTF-8 failed."""
        keep = []
        for n in names:
            if n.startswith("."):
                continue
            if not _utf8(n):
                failed.append(f"{shown(os.path.join(dirpath, n))}: the name is not valid UTF-8 (Blob names must be); "
                              f"rename it to export {what}")
                continue
            keep.append(n)
        return keep

    for dirpath, dirnames, filenames in os.walk(top, onerror=unreadable):
        rel_dir = Path(dirpath).relative_to(top).as_posix()
        dirnames[:] = exportable(dirpath, dirnames, "what is under it")
        for n in exportable(dirpath, filenames, "it"):
            try:
                st = os.lstat(os.path.join(dirpath, n))
            except FileNotFoundError:       # deleted since the directory was read
                continue
            except OSError as e:
                failed.append(f"{shown(os.path.join(dirpath, n))}: cannot stat ({e.strerror or e})")
                continue
            if stat.S_ISREG(st.st_mode):    # lstat: a symlink is not a regular file
                out[n if rel_dir == "." else f"{rel_dir}/{n}"] = st
    return out, failed


class _Changed(Exception):
    """The file at a discovered path is no longer the file that was discovered."""


def default_status_path(root: str | os.PathLike[str]) -> Path:
    """Next to the root, not inside it: outside the exported tree, and it survives a wipe of it."""
    r = Path(root).resolve()
    return r.parent / f".{r.name}.export-status.json"


def read_status(path: str | os.PathLike[str]) -> ExportStatus | None:
    try:
        # fsafe: a FIFO or a symlink planted at the status path must not hang or redirect `status`.
        d = json.loads(fsafe.read_file(path, limit=16 << 20))
        return ExportStatus(**{k: v for k, v in d.items() if k in ExportStatus.__dataclass_fields__})
    except (OSError, ValueError, TypeError, AttributeError):
        return None


class Exporter:
    """models: the model directories to export (None: the whole root, as AMLFS exports its whole
    file system); `tiered-ckpt export` passes the one model it was given unless --all-models."""

    def __init__(self, cfg: NodeConfig, store: BlobStore | None = None, status_path: str | os.PathLike[str] | None = None,
                 models: Sequence[str] | None = None) -> None:
        if cfg.backend != "local":
            raise UserError(
                "`tiered-ckpt export` is the local stand-in for AMLFS auto-export; with backend amlfs the "
                "auto-export job does this (see `tiered-ckpt status`). Use --backend local for local mode."
            )
        self.cfg = cfg
        self.root = Path(cfg.root)
        self.store = store or BlobStore(cfg.archive)
        self.status_path = Path(status_path) if status_path else default_status_path(cfg.root)
        self.status = read_status(self.status_path) or ExportStatus()
        self.unreadable: list[str] = []      # what the last walk could not consider
        self.models = list(models) if models is not None else None

    # -- discovery ------------------------------------------------------------------------
    def walk(self) -> dict[str, os.stat_result]:
        if self.models is None:
            files, self.unreadable = walk_tree(self.root)
            return files
        out: dict[str, os.stat_result] = {}
        self.unreadable = []
        for m in self.models:
            top = self.root / m
            if not fsafe.is_real_dir(top):
                continue        # nothing saved yet, or a symlink (never followed)
            files, bad = walk_tree(top)
            out.update({f"{m}/{rel}": st for rel, st in files.items()})
            self.unreadable += bad
        return out

    @staticmethod
    def changed(st: os.stat_result, blob: BlobInfo | None) -> bool:
        if blob is None or META_HASH not in blob.metadata:
            return True
        md = blob.metadata
        return md.get(META_SIZE) != str(st.st_size) or md.get(META_MTIME) != str(st.st_mtime_ns) or blob.size != st.st_size

    def discover(self) -> list[tuple[str, os.stat_result]]:
        files = self.walk()
        blobs: dict[str, BlobInfo] = {}
        for prefix in ([""] if self.models is None else self.models):
            blobs.update(self.store.listing(prefix))
        todo = []
        for rel, st in files.items():
            b = blobs.get(rel)
            if self.changed(st, b) and not self._same_bytes(rel, st, b):
                todo.append((rel, st))
        return sorted(todo, key=lambda x: x[0])

    def _same_bytes(self, rel: str, st: os.stat_result, blob: BlobInfo | None) -> bool:
        """A file whose size matches its blob but whose mtime does not (a restore just wrote it from
        that very blob) is hashed: the same bytes are not uploaded again, only the blob's recorded
        mtime is brought up to date (AMLFS does not re-export a file an import brought back either)."""
        if blob is None or META_HASH not in blob.metadata or blob.size != st.st_size \
                or blob.metadata.get(META_SIZE) != str(st.st_size):
            return False
        try:
            fd = fsafe.open_file(self.root / rel, os.O_RDONLY, anchor=self.root)
        except OSError:
            return False
        try:
            now = os.fstat(fd)
            if (now.st_ino, now.st_size, now.st_mtime_ns) != (st.st_ino, st.st_size, st.st_mtime_ns):
                return False
            if hash_fd(fd) != blob.metadata[META_HASH]:
                return False
        finally:
            os.close(fd)
        try:
            self.store.set_metadata(rel, {**blob.metadata, META_MTIME: str(st.st_mtime_ns)})
        except UserError:
            return False
        return True

    # -- one iteration ----------------------------------------------------------------------
    def _export_one(self, rel: str, st: os.stat_result, per_file: int) -> int:
        # Open first, then check that the descriptor is the file discovered: between the lstat
        # of discovery and now, the path may have been swapped (for a symlink to a secret, say).
        fd = fsafe.open_file(self.root / rel, os.O_RDONLY, anchor=self.root)
        with os.fdopen(fd, "rb") as f:
            now = os.fstat(f.fileno())
            if (now.st_dev, now.st_ino, now.st_size) != (st.st_dev, st.st_ino, st.st_size):
                raise _Changed(rel)
            meta = {META_SIZE: str(st.st_size), META_MTIME: str(st.st_mtime_ns)}
            size, digest = self.store.upload_fileobj(f, rel, metadata=meta, length=st.st_size, concurrency=per_file)
        self.store.set_metadata(rel, {**meta, META_HASH: digest})
        return size

    def iterate(self, on_file: Callable[[str, int], None] | None = None) -> Iteration:
        """Discover and upload new/changed files once; never raises for one file's failure."""
        it = Iteration(started_utc=_now())
        t0 = time.monotonic()
        try:
            todo = self.discover()
        except UserError as e:
            it.files_failed = 1
            it.errors.append(str(e))
            todo = []
        it.files_failed += len(self.unreadable)
        it.errors += self.unreadable
        it.files_discovered = len(todo)
        if todo:
            workers = max(1, min(self.cfg.archive.concurrency, len(todo)))
            per_file = max(1, self.cfg.archive.concurrency // workers)

            def one(item: tuple[str, os.stat_result]) -> tuple[str, int | None, str]:
                rel, st = item
                try:
                    return rel, self._export_one(rel, st, per_file), ""
                except (FileNotFoundError, _Changed):
                    return rel, None, ""         # deleted or rewritten since discovery: the next iteration sees it
                except fsafe.UnsafePath as e:
                    return rel, None, f"{rel}: {e.strerror}; not exported"
                except (UserError, OSError) as e:
                    return rel, None, f"{rel}: {e}"

            with ThreadPoolExecutor(workers) as ex:
                for rel, n, err in ex.map(one, todo):
                    if n is not None:
                        it.files_exported += 1
                        it.bytes_exported += n
                        it.exported.append(rel)
                        if on_file is not None:
                            on_file(rel, n)
                    elif err:
                        it.files_failed += 1
                        it.errors.append(err)
        it.seconds = time.monotonic() - t0
        it.completed_utc = _now()
        self._record(it)
        info = fields("export", model=self.cfg.model, duration_s=it.seconds, nbytes=it.bytes_exported,
                      outcome="ok" if it.ok else "failed", files_discovered=it.files_discovered,
                      files_exported=it.files_exported, files_failed=it.files_failed)
        if it.ok:
            # An idle iteration (nothing new) is the common case of --watch: not worth a line at INFO.
            log.log(logging.INFO if it.files_discovered else logging.DEBUG,
                    "export iteration: %d exported (%d bytes) of %d new/changed in %.1fs", it.files_exported,
                    it.bytes_exported, it.files_discovered, it.seconds, extra=info)
        else:
            log.warning("export iteration: %d file(s) failed (first: %s)", it.files_failed,
                        it.errors[0] if it.errors else "-", extra=info)
        return it

    def _record(self, it: Iteration) -> None:
        s = self.status
        s.iterations += 1
        s.total_files_failed += it.files_failed
        s.state = "InProgress" if it.ok else "Failed"
        if it.ok:
            s.last_successful_iteration_utc = it.completed_utc
        d = asdict(it)
        d["exported"] = d["exported"][:100]
        d["errors"] = [redact(e) for e in d["errors"][:20]]   # the status file may be read by anyone
        s.last_iteration = d
        self.status_path.parent.mkdir(parents=True, exist_ok=True)
        # A status file, not checkpoint data: a rename is fine here. Through fsafe: a FIFO planted at
        # its temporary name must not hang the exporter; a device given as --export-status is refused.
        fsafe.replace_own(self.status_path, json.dumps(asdict(s), indent=1).encode())

    def watch(self, interval: float = 5.0, stop: threading.Event | None = None, max_iterations: int | None = None,
              on_iteration: Callable[[Iteration], None] | None = None) -> None:
        """Iterate until `stop` is set (or Ctrl-C / SIGTERM); an iteration starts every `interval` s."""
        stop = stop or threading.Event()
        n = 0
        while not stop.is_set():
            t0 = time.monotonic()
            it = self.iterate()
            n += 1
            if on_iteration is not None:
                on_iteration(it)
            if max_iterations is not None and n >= max_iterations:
                break
            stop.wait(max(0.0, interval - (time.monotonic() - t0)))
