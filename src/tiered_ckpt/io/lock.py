"""One actor at a time: flocks on the shared file system.

* `exclusive(lock_path(root, model))`: one retention run per model at a time.
* `checkpoint_lock(root, model, name)`: one actor per checkpoint name at a time: a save
  (rank 0, from the claim until the marker is written), a restore, and retention's delete or
  release of that checkpoint exclude each other. A second saver of the same name gets
  ConflictError at once; a restore waits (with a timeout); retention skips a busy checkpoint.

Lustre mounted with `-o flock` (what the cluster's fstab uses) makes flock coherent across
nodes. The kernel drops the lock when its holder dies (even SIGKILL), so there is no stale
lock to clean up; the file's content (who holds it) only serves the error message. Lock files
live under dot-names (never exported) and are opened through fsafe: a planted symlink or hard
link is refused, never truncated.
"""
from __future__ import annotations

import fcntl
import json
import os
import socket
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from tiered_ckpt.errors import EXIT_CONFLICT, EXIT_UNAVAILABLE, EXIT_USAGE, ConflictError, UserError
from tiered_ckpt.io import fsafe, mounts

LOCK_NAME = ".retention.lock"
CHECKPOINT_LOCKS = ".locks"      # <root>/<model>/.locks/<checkpoint name>.lock


def lock_path(root: str | os.PathLike[str], model: str) -> Path:
    return Path(root) / model / LOCK_NAME


def checkpoint_lock_path(root: str | os.PathLike[str], model: str, name: str) -> Path:
    return Path(root) / model / CHECKPOINT_LOCKS / f"{name}.lock"


def _holder(fd: int) -> str:
    try:
        info = json.loads(os.pread(fd, 4096, 0).decode(errors="replace").strip())
        return f"pid {info.get('pid')} on {info.get('host')} ({info.get('purpose')}, since {info.get('since')})"
    except (OSError, ValueError, AttributeError):
        return ""


def _open_lock(p: Path, anchor: Path | None) -> int:
    try:
        if anchor is not None:
            os.close(fsafe.make_dirs(p.parent, anchor=anchor))
        else:
            p.parent.mkdir(parents=True, exist_ok=True)
        try:
            fd = fsafe.open_file(p, os.O_RDWR | os.O_CREAT | os.O_EXCL, fsafe.LOCK_MODE, anchor=anchor)
        except FileExistsError:
            return fsafe.open_file(p, os.O_RDWR, anchor=anchor)
        os.fchmod(fd, fsafe.LOCK_MODE)   # ours: every actor opens it read-write (fsafe.LOCK_MODE)
        return fd
    except fsafe.UnsafePath as e:
        raise UserError(f"lock file {p}: {e.strerror}; remove it (someone planted it there) and re-run", exit_code=EXIT_CONFLICT) from None
    except OSError as e:
        raise UserError(f"cannot create or open the lock file {p}: {e.strerror}; check the permissions of {p.parent} "
                        "(the training users and the retention service share its group)", exit_code=EXIT_USAGE) from None


def _flock(fd: int, p: Path, wait: float | None) -> bool:
    """Take the lock; False if still held by another after `wait` seconds (0: don't wait, None: forever)."""
    deadline = None if wait is None else time.monotonic() + wait
    delay = 0.01
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            pass
        except OSError as e:
            raise UserError(
                f"cannot lock {p}: {e.strerror}; on Lustre mount with `-o flock` (the cluster's fstab does) "
                "so that one node at a time changes these checkpoints",
                exit_code=EXIT_UNAVAILABLE,
            ) from None
        if deadline is not None and time.monotonic() >= deadline:
            return False
        time.sleep(delay if deadline is None else max(0.0, min(delay, deadline - time.monotonic())))
        delay = min(delay * 2, 0.25)


@contextmanager
def _held(p: Path, purpose: str, wait: float | None, anchor: Path | None, busy: str) -> Iterator[None]:
    # A Lustre client mounted with localflock would grant this lock on every node at once.
    problem = mounts.flock_problem(anchor if anchor is not None else p.parent)
    if problem is not None:
        raise UserError(f"cannot take the lock {p}: {problem}", exit_code=EXIT_UNAVAILABLE)
    fd = _open_lock(p, anchor)
    try:
        if not _flock(fd, p, wait):
            holder = _holder(fd)
            raise ConflictError(f"{p} is locked by another process{': ' + holder if holder else ''}; {busy}")
        info = json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "purpose": purpose,
                           "since": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())})
        os.ftruncate(fd, 0)
        os.pwrite(fd, info.encode(), 0)
        try:
            yield
        finally:
            try:
                os.ftruncate(fd, 0)
            finally:
                fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)


@contextmanager
def checkpoint_lock(root: str | os.PathLike[str], model: str, name: str, purpose: str,
                    wait: float | None = 0.0) -> Iterator[None]:
    """Hold the lock of one checkpoint name; ConflictError naming the holder if it stays busy.

    wait: seconds to wait for a holder to finish (0 = fail at once, None = wait forever).
    """
    p = checkpoint_lock_path(root, model, name)
    why = (f"another process is working on checkpoint {name} ({purpose} needs it alone)"
           + (f"; waited {wait:g} s" if wait else "") + " — wait for it to finish and re-run")
    with _held(p, purpose, wait, Path(root), why):
        yield


@contextmanager
def exclusive(path: str | os.PathLike[str], purpose: str, *, anchor: str | os.PathLike[str] | None = None) -> Iterator[None]:
    """Hold an exclusive lock on `path` or raise ConflictError naming the holder; `anchor`: the
    trusted root below which no directory of `path` is followed through a symlink (fsafe)."""
    p = Path(path)
    with _held(p, purpose, 0.0, Path(anchor) if anchor is not None else None,
               "only one node may change these checkpoints at a time — wait for it to finish and re-run"):
        yield
