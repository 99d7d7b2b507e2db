"""Restore (rehydrate): make a committed checkpoint readable on the accelerator layer.

The newest committed checkpoint is found by scanning markers on both tiers (no "latest"
pointer). A checkpoint is committed in Blob when its COMMITTED.json blob parses and every
file it names has a blob of the right size. Where a name is committed on both tiers, the
accelerator layer's copy is used as it is; files of two generations are never combined (a
restore from the archive brings every file its marker names, each checked against that
marker's hash). The cheapest path wins:

* resident: nothing to copy; sizes checked, hashes with --verify;
* released (AMLFS): batched `lfs hsm_restore`, then wait until resident; the files that came
  back from the archive are hash-checked;
* only in the archive: AMLFS import job for the checkpoint's prefix (arm.AmlfsJobs disables
  auto-export, imports, re-enables it, always), or, locally, a parallel download from Blob.
  Every file is checked against the marker's xxh3-128 (xxh3 runs far faster than any archive
  delivers bytes): a copy that differs is refused, naming the file, and no marker is written.

The whole restore holds the checkpoint's lock (lock.checkpoint_lock, waiting up to
`lock_wait` seconds): retention cannot delete or release it meanwhile, a second restore of
the same checkpoint waits for the first (and re-checks what is there once it gets the lock),
a save of that name cannot interleave. The marker is written LAST, with the archive marker's
exact bytes: an interrupted or failed restore leaves a directory without a marker, which no
scan ever takes as complete. Locally each file is downloaded into a temp file of its own
(O_EXCL, pid + random suffix, a dot-name the exporter skips) and takes its final name only when
complete and hash-checked. Nothing under the root is opened through a symlink (fsafe, anchored
at the root); a checkpoint directory that is a symlink is refused. A successful restore is
recorded so that retention keeps the checkpoint for retention.restore_grace.

Nothing here renders: progress goes to a callback (`RestoreProgress`), which the command line
turns into a progress bar (cli/lifecycle.py) and a test or a caller may use as it likes.
"""
from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tiered_ckpt import records
from tiered_ckpt.config import NodeConfig
from tiered_ckpt.errors import EXIT_CONFLICT, EXIT_FAILED, ConflictError, IntegrityError, UnavailableError, UserError
from tiered_ckpt.io import commit, fsafe
from tiered_ckpt.io.lock import checkpoint_lock
from tiered_ckpt.io.marker import MARKER, FileEntry, Manifest, parse_marker
from tiered_ckpt.io.posix import os_error
from tiered_ckpt.lifecycle import restore_lease, tombstone
from tiered_ckpt.lifecycle.journal import forget, note_restored
from tiered_ckpt.logs import fields
from tiered_ckpt.naming import DEFAULT as DEFAULT_NAMING
from tiered_ckpt.naming import require_name
from tiered_ckpt.tiers.backends import TierBackend, archive_damaged, ensure_dir, hash_at
from tiered_ckpt.tiers.blob import BlobInfo, BlobStore, archived_markers

DEFAULT_LOCK_WAIT = 600.0     # seconds a restore waits for another actor on the same checkpoint

# (what, bytes done, bytes total): `what` names the step and the checkpoint, e.g.
# "restore global_epoch0_step30" (download or import) or "hsm_restore global_epoch0_step30"
# (released files coming back). Called as bytes arrive, from the threads that move them, one
# call at a time and with `done` never decreasing.
RestoreProgress = Callable[[str, int, int], None]

# What a restore checked (RestoreResult.check).
HASHES = "hashes"
SIZES = "sizes"
NO_HASHES = "sizes only: saved without hashes"

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Found:
    manifest: Manifest
    where: str                # "accelerator" (committed on Lustre/local dir) or "archive"
    marker: bytes = b""       # the marker's bytes on that tier


@dataclass
class RestoreResult:
    name: str
    path: str
    source: str               # resident | released | archive
    bytes: int
    seconds: float
    verified: bool            # every file's bytes were checked against the marker's hash
    files: int
    prefetched_files: int = 0
    warnings: list[str] = field(default_factory=list)
    check: str = SIZES        # hashes | sizes | sizes only: saved without hashes

    @property
    def gbps(self) -> float:
        return self.bytes / self.seconds / 1e9 if self.seconds > 0 else 0.0

    def to_json(self) -> dict[str, Any]:
        return {"ok": True, "name": self.name, "path": self.path, "source": self.source, "bytes": self.bytes,
                "seconds": round(self.seconds, 3), "gb_per_s": round(self.gbps, 3), "verified": self.verified,
                "check": self.check, "files": self.files, "prefetched_files": self.prefetched_files,
                "warnings": self.warnings}


class _Bytes:
    """Adds up the bytes reported by several threads and passes (what, done, total) on."""

    def __init__(self, progress: RestoreProgress | None, what: str, total: int) -> None:
        self._progress, self._what, self._total = progress, what, total
        self._done = 0
        self._lock = threading.Lock()

    def advance(self, n: int) -> None:
        if self._progress is None:
            return
        # Under the lock, so that the caller sees one call at a time and `done` in order.
        with self._lock:
            self._done += n
            self._progress(self._what, self._done, self._total)


# -- which checkpoint: committed on either tier ------------------------------------------------

def _archive_found(store: BlobStore, model: str, blobs: Mapping[str, BlobInfo],
                   naming: str = DEFAULT_NAMING) -> dict[str, Found]:
    out: dict[str, Found] = {}
    for marker in archived_markers(store, blobs, naming):
        m = marker.manifest
        if m is None or not m.files:
            continue
        base = f"{model}/{m.name}/"
        if all((b := blobs.get(base + f.path)) is not None and b.size == f.size for f in m.files):
            out[m.name] = Found(m, "archive", marker.data)
    return out


def archive_committed(store: BlobStore, model: str, listing: Mapping[str, BlobInfo] | None = None,
                      naming: str = DEFAULT_NAMING) -> list[Manifest]:
    """Checkpoints committed in Blob: marker parses, names itself, every file present with its size.

    `listing`: the model's blobs when the caller has listed them already (status).
    """
    blobs = store.listing(model) if listing is None else listing
    return sorted((f.manifest for f in _archive_found(store, model, blobs, naming).values()), key=lambda m: m.id)


def _local_found(cfg: NodeConfig, name: str) -> Found | None:
    """Checkpoint `name` if committed on the accelerator layer (marker valid, sizes right)."""
    root = Path(cfg.root)
    d = commit.model_dir(root, cfg.model) / name
    if not fsafe.is_real_dir(d):
        return None
    try:
        data = commit.marker_bytes(d, anchor=root)
        if data is None:
            return None
        m = parse_marker(data, name)    # epoch/step must be those of the directory's name
    except (OSError, ValueError):
        return None
    if m.naming != cfg.naming or m.name != name or not m.files or commit.size_problems(d, m, anchor=root):
        return None
    return Found(m, "accelerator", data)


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
            found.update(_archive_found(backend.store, cfg.model, backend.store.listing(cfg.model), cfg.naming))
        except UnavailableError as e:
            unreachable = e
    for c in commit.committed(commit.scan(cfg.root, cfg.model, cfg.naming)):
        local = _local_found(cfg, c.name)
        if local is not None:
            found[c.name] = local
    if unreachable is not None:
        if not found:
            raise unreachable
        if warnings is not None:
            warnings.append(f"archive not consulted, only the accelerator layer: {unreachable}")
    return found


def _resolve(cfg: NodeConfig, backend: TierBackend, name: str) -> Found | None:
    """Where checkpoint `name` is committed now (the accelerator layer first)."""
    local = _local_found(cfg, name)
    if local is not None or not backend.archive_configured:
        return local
    store = backend.store
    return _archive_found(store, cfg.model, store.listing(f"{cfg.model}/{name}"), cfg.naming).get(name)


def choose(cfg: NodeConfig, backend: TierBackend, name: str | None, warnings: list[str] | None = None) -> Found:
    if name is not None:
        require_name(name, cfg.naming)
    found = committed_anywhere(cfg, backend, warnings)
    if name is not None:
        if name not in found:
            raise UserError(
                f"checkpoint {name} of model {cfg.model!r} is not committed on the accelerator layer ({cfg.root}) "
                f"nor in the archive; `tiered-ckpt status` lists what exists",
                exit_code=EXIT_FAILED,
            )
        return found[name]
    if not found:
        raise UserError(
            f"no committed checkpoint of model {cfg.model!r} under {cfg.root} or in the archive; nothing to restore",
            exit_code=EXIT_FAILED,
        )
    return found[max(found, key=lambda n: found[n].manifest.id)]


def resume_point(cfg: NodeConfig, backend: TierBackend, name: str | None = None, *,
                 progress: RestoreProgress | None = None,
                 lock_wait: float | None = DEFAULT_LOCK_WAIT) -> str | None:
    """What a training restart loads: `name`, else the newest checkpoint committed on EITHER tier,
    made readable on the accelerator layer first when only the archive holds it (a restore, as
    `tiered-ckpt restore NAME` does). None when neither tier holds a committed checkpoint: a first
    start, nothing to resume.

    The accelerator layer is read cheaply (newest first, stopping at the first committed one);
    the archive is listed only where one is configured. A checkpoint committed on the accelerator
    layer (resident or released) is used in place: reading a released AMLFS file restores it
    (HSM). If the archive cannot be reached, a committed local checkpoint is used and a warning
    logged (a restart does not wait for Blob); with nothing local the UnavailableError stands,
    because "nothing to resume" cannot be told from "the archive did not answer".
    """
    if cfg.backend == "amlfs" or not backend.archive_configured:
        commit.require_root(cfg.root, "root")   # AMLFS not mounted is not "nothing to resume"
    if name is not None:
        require_name(name, cfg.naming)
        if _local_found(cfg, name) is not None or not backend.archive_configured:
            return name
        if _resolve(cfg, backend, name) is not None:
            restore(cfg, backend, name, progress=progress, lock_wait=lock_wait)
        return name        # not committed anywhere: the reader's own message says so
    newest, where = _newest(cfg, backend)
    if newest is not None and where == "archive":
        log.info("the newest committed checkpoint %s is only in the archive: restoring it", newest.name,
                 extra=fields("resume", model=cfg.model, checkpoint=newest.name))
        return restore(cfg, backend, newest.name, progress=progress, lock_wait=lock_wait).name
    return newest.name if newest is not None else None


def newest_committed(cfg: NodeConfig, backend: TierBackend) -> Manifest | None:
    """The newest checkpoint committed on either tier (archive listed where configured); restores nothing."""
    return _newest(cfg, backend)[0]


def _newest(cfg: NodeConfig, backend: TierBackend) -> tuple[Manifest | None, str]:
    local = commit.latest_committed(cfg.root, cfg.model, cfg.naming) if Path(cfg.root).is_dir() else None
    newest = local.manifest if local is not None else None
    if backend.archive_configured:
        try:
            archived = _archive_found(backend.store, cfg.model, backend.store.listing(cfg.model), cfg.naming)
        except UnavailableError as e:
            if newest is None:
                raise
            log.warning("archive not consulted for the newest checkpoint, only the accelerator layer: %s", e,
                        extra=fields("resume", model=cfg.model, checkpoint=newest.name))
            archived = {}
        top = max((f.manifest for f in archived.values()), key=lambda m: m.id, default=None)
        if top is not None and (newest is None or top.id > newest.id):
            return top, "archive"
    return newest, "accelerator"


# -- checks -------------------------------------------------------------------------------------

def _hash_problems(root: Path, ckpt_dir: Path, files: list[FileEntry], workers: int) -> list[tuple[FileEntry, str]]:
    def check(f: FileEntry) -> tuple[FileEntry, str] | None:
        if f.hash is None:
            return None
        got = hash_at(root, ckpt_dir / f.path)
        return None if got == f.hash else (f, got)

    with ThreadPoolExecutor(max(1, min(workers, len(files) or 1))) as ex:
        return [p for p in ex.map(check, files) if p]


def verify_hashes(ckpt_dir: Path, m: Manifest, workers: int = 4, root: Path | None = None) -> None:
    """Check every file of a resident checkpoint against its marker's hashes (IntegrityError)."""
    bad = _hash_problems(root or ckpt_dir.parent.parent, ckpt_dir, m.files, workers)
    if bad:
        f, got = bad[0]
        raise IntegrityError(
            f"checkpoint {m.name} failed hash verification: {ckpt_dir / f.path}: xxh3-128 {got}, manifest says {f.hash}"
            + (f" (and {len(bad) - 1} more)" if len(bad) > 1 else "")
            + "; the copy on the accelerator layer differs from what was committed — do not train from it. If the "
            "archive holds this checkpoint (`tiered-ckpt status`), move the directory aside and run "
            f"`tiered-ckpt restore {m.name}`: a restore from the archive checks every file against the marker"
        )


def _refuse_links(root: Path, model: str, ckpt_dir: Path) -> None:
    for p in (commit.model_dir(root, model), ckpt_dir):
        if os.path.lexists(p) and not fsafe.is_real_dir(p):
            raise UserError(
                f"{p} is a symbolic link or not a directory: restore never writes through a link (it could point "
                "anywhere on this node); remove it (or move it aside) and re-run",
                exit_code=EXIT_CONFLICT,
            )


# -- the restore: under the checkpoint's lock, resident / released / from the archive ------------

def restore(cfg: NodeConfig, backend: TierBackend, name: str | None = None, *, verify: bool = False,
            progress: RestoreProgress | None = None,
            lock_wait: float | None = DEFAULT_LOCK_WAIT) -> RestoreResult:
    """Make checkpoint `name` (or the newest committed anywhere) readable; see the module doc.

    progress: called with (what, bytes done, bytes total) as bytes come back from the archive.

    lock_wait: seconds to wait for another actor (a restore, retention, a save) holding the
    checkpoint's lock; ConflictError naming it after that (None: wait forever).
    """
    t0 = time.monotonic()
    try:
        return _restore(cfg, backend, name, verify, progress, lock_wait)
    except Exception as e:
        log.error("restore of %s failed: %s", name or "the newest checkpoint", e,
                  extra=fields("restore", model=cfg.model, checkpoint=name, duration_s=time.monotonic() - t0,
                               outcome="error"))
        raise


def _restore(cfg: NodeConfig, backend: TierBackend, name: str | None, verify: bool,
             progress: RestoreProgress | None, lock_wait: float | None) -> RestoreResult:
    root = Path(cfg.root)
    if cfg.backend == "amlfs":
        # Never create the root: with AMLFS not mounted, that would restore onto the OS disk.
        commit.require_root(root)
    else:
        root.mkdir(parents=True, exist_ok=True)   # local mode: the directory is the accelerator layer
    warnings: list[str] = []
    target = choose(cfg, backend, name, warnings)
    cname = target.manifest.name
    ckpt_dir = commit.model_dir(root, cfg.model) / cname
    _refuse_links(root, cfg.model, ckpt_dir)
    t0 = time.monotonic()
    try:
        with ExitStack() as stack:
            try:
                stack.enter_context(checkpoint_lock(root, cfg.model, cname, "restore", wait=lock_wait))
            except ConflictError as e:
                raise ConflictError(f"{e} (restore waited {lock_wait:g} s; raise it with --wait SECONDS)"
                                    if lock_wait else str(e)) from None
            # What was chosen may have changed while this waited (another restore finished it,
            # retention deleted it): decide again under the lock.
            _refuse_links(root, cfg.model, ckpt_dir)
            found = _resolve(cfg, backend, cname)
            if found is None:
                raise UserError(
                    f"checkpoint {cname} of model {cfg.model!r} is no longer committed on the accelerator layer nor in "
                    "the archive (deleted while this restore waited for it); `tiered-ckpt status` lists what exists",
                    exit_code=EXIT_FAILED,
                )
            if found.where == "accelerator":
                res = _in_place(cfg, backend, found, ckpt_dir, verify, progress, warnings)
            else:
                stack.enter_context(_leased(cfg, backend, cname, warnings))
                res = _from_archive(cfg, backend, found, ckpt_dir, progress, warnings)
            res.seconds = time.monotonic() - t0
            _bookkeeping(cfg, cname, res)
            _record(cfg, res)
            return res
    except fsafe.UnsafePath as e:
        raise UserError(f"{e.filename}: {e.strerror}; restore never follows links in the checkpoint tree — "
                        "remove it and re-run", exit_code=EXIT_CONFLICT) from None
    raise AssertionError("unreachable")       # for mypy: the with block always returns or raises


def _record(cfg: NodeConfig, res: RestoreResult) -> None:
    """The last restore by path, for `tiered-ckpt metrics` (resident / released / import / download)."""
    path = res.source if res.source != "archive" else ("import" if cfg.backend == "amlfs" else "download")
    by = dict((records.read(cfg.root, cfg.model, records.RESTORE) or {}).get("by_path") or {})
    by[path] = {"name": res.name, "seconds": res.seconds, "bytes": res.bytes}
    records.record(cfg.root, cfg.model, records.RESTORE, {"by_path": by, "last": {"path": path, **by[path]}},
                   totals={path: 1})
    log.info("restored %s by %s: %d bytes in %.2fs (%s)", res.name, path, res.bytes, res.seconds, res.check,
             extra=fields("restore", model=cfg.model, checkpoint=res.name, duration_s=res.seconds, nbytes=res.bytes,
                          path=path, check=res.check, files=res.files, warnings=res.warnings or None))


def _bookkeeping(cfg: NodeConfig, name: str, res: RestoreResult) -> None:
    """After a successful restore: no delete journal entry, no tombstone, a restore record."""
    try:
        forget(cfg.root, cfg.model, name)
        tombstone.clear(cfg.root, cfg.model, name)
        note_restored(cfg.root, cfg.model, name)
    except OSError as e:
        # The checkpoint is restored and committed; only retention's grace period is lost.
        res.warnings.append(f"could not record the restore of {name} for retention's grace period: {e}")


def _in_place(cfg: NodeConfig, backend: TierBackend, found: Found, ckpt_dir: Path, verify: bool,
              progress: RestoreProgress | None, warnings: list[str]) -> RestoreResult:
    root = Path(cfg.root)
    m = found.manifest
    paths = [str(ckpt_dir / f.path) for f in m.files]
    prefetched = backend.prefetch(paths, _Bytes(progress, f"hsm_restore {m.name}", m.total_bytes).advance)
    problems = commit.size_problems(ckpt_dir, m, anchor=root)
    if problems:
        raise IntegrityError(f"checkpoint {m.name}: {problems[0]}")
    from_archive = set(prefetched)
    # Bytes that came back from the archive (hsm_restore) are always checked; the rest only
    # with --verify (reading a large resident checkpoint just to start training is not free).
    to_hash = m.files if verify else [f for f in m.files if str(ckpt_dir / f.path) in from_archive]
    bad = _hash_problems(root, ckpt_dir, to_hash, cfg.archive.concurrency)
    if bad:
        f, got = bad[0]
        if str(ckpt_dir / f.path) in from_archive:
            raise archive_damaged(m.name, ckpt_dir / f.path, got, str(f.hash))
        verify_hashes(ckpt_dir, m, cfg.archive.concurrency, root)
    unhashed = any(f.hash is None for f in m.files)
    verified = len(to_hash) == len(m.files) and not unhashed
    check = HASHES if verified else (NO_HASHES if unhashed and (verify or prefetched) else SIZES)
    if unhashed and (verify or prefetched):
        warnings.append(f"checkpoint {m.name} was saved without hashes (hash=False): only sizes could be checked")
    return RestoreResult(m.name, str(ckpt_dir), "released" if prefetched else "resident", m.total_bytes,
                         0.0, verified, len(m.files), len(prefetched), warnings, check)


@contextmanager
def _leased(cfg: NodeConfig, backend: TierBackend, name: str, warnings: list[str]) -> Iterator[None]:
    """Hold a restore lease in the archive while its blobs are read (restore_lease.py): archive
    retention keeps the checkpoint meanwhile, or this restore stops if a delete is under way."""
    store = backend.store
    try:
        restore_lease.take(store, cfg.model, name)
    except UserError as e:
        # A read-only identity restores still; only the guard against archive retention is lost.
        warnings.append(f"could not write the restore lease of {name} to the archive ({e}); archive retention "
                        "running at the same moment could delete it mid-restore")
        yield
        return
    try:
        age = restore_lease.being_deleted(store, cfg.model, name)
        if age is not None:
            raise ConflictError(f"archive retention started deleting checkpoint {name} from the archive {age:.0f} s ago; "
                                "it was not restored — restore another checkpoint (tiered-ckpt status lists them), or "
                                "re-run if that retention run keeps it")
        yield
    finally:
        try:
            restore_lease.release(store, cfg.model, name)
        except UserError as e:
            warnings.append(f"could not remove the restore lease of {name} ({e}); it expires by itself")


def _from_archive(cfg: NodeConfig, backend: TierBackend, found: Found, ckpt_dir: Path,
                  progress: RestoreProgress | None, warnings: list[str]) -> RestoreResult:
    root = Path(cfg.root)
    m = found.manifest
    # A journal entry left by a killed retention run would let the next run take this
    # directory, still without its marker, for an interrupted delete: drop it first.
    forget(root, cfg.model, m.name)
    try:
        dfd = ensure_dir(root, ckpt_dir)
        try:
            # A marker left here is stale (the directory is not committed, or _resolve would
            # have said so): remove it before any data arrives so that the directory never
            # looks complete too early.
            try:
                os.unlink(MARKER, dir_fd=dfd)
                os.fsync(dfd)
            except FileNotFoundError:
                pass
        finally:
            os.close(dfd)
    except fsafe.UnsafePath:
        raise
    except OSError as e:
        raise os_error(e, e.filename or ckpt_dir) from None
    done = False
    foreign = False     # a marker someone else wrote meanwhile: never ours to remove
    try:
        try:
            hashed = backend.rehydrate(m, ckpt_dir, _Bytes(progress, f"restore {m.name}", m.total_bytes).advance)
        except fsafe.UnsafePath:
            raise
        except OSError as e:
            # The local side of a download (ENOSPC, EACCES, ...): the blob store only turns the
            # archive's own errors into UserErrors. No marker yet, so nothing looks restored.
            raise os_error(e, e.filename or ckpt_dir) from None
        problems = commit.size_problems(ckpt_dir, m, anchor=root)
        if problems:
            raise IntegrityError(f"restored checkpoint {m.name} is incomplete: {problems[0]}; re-run restore")
        marker = ckpt_dir / MARKER
        present = commit.marker_bytes(ckpt_dir, anchor=root)           # AMLFS imports bring the marker themselves
        if present is None:
            try:
                fsafe.write_file(marker, found.marker, exclusive=True, anchor=root)
                commit.fsync_dir(ckpt_dir)
            except fsafe.UnsafePath:
                raise
            except FileExistsError:
                foreign = True
                raise ConflictError(f"{marker} appeared while restoring {m.name}; another process wrote it — "
                                    "check `tiered-ckpt status` and re-run") from None
            except OSError as e:
                raise os_error(e, marker) from None
        elif present != found.marker:
            raise IntegrityError(
                f"the archive's marker of {m.name} changed during the restore (a later save of this name was exported); "
                "nothing is committed; re-run restore")
        done = True
    finally:
        if not done and not foreign:
            # Whatever the failure, nothing may look committed (an AMLFS import brings the
            # archive's marker with the data, before the data could be checked).
            try:
                if fsafe.unlink(ckpt_dir / MARKER, anchor=root):
                    commit.fsync_dir(ckpt_dir)
            except OSError:
                pass
    if not hashed:
        warnings.append(f"checkpoint {m.name} was saved without hashes (hash=False): only sizes (and any hash the "
                        "exporter recorded) were checked")
    return RestoreResult(m.name, str(ckpt_dir), "archive", m.total_bytes, 0.0, hashed, len(m.files),
                         warnings=warnings, check=HASHES if hashed else NO_HASHES)


__all__ = ["DEFAULT_LOCK_WAIT", "Found", "RestoreProgress", "RestoreResult", "archive_committed", "choose", "committed_anywhere",
           "restore", "verify_hashes"]
