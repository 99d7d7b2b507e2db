"""One actor at a time on a model's checkpoints: an flock on the shared file system.

Lustre mounted with `-o flock` (what the cluster's fstab uses) makes flock coherent across
nodes, so two nodes' retention timers never delete at the same time. The kernel drops the
lock when its holder dies (even SIGKILL), so there is no stale lock to clean up; the file's
content (who holds it) only serves the error message.
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

from .errors import ConflictError, UserError

LOCK_NAME = ".retention.lock"


def lock_path(root: str | os.PathLike[str], model: str) -> Path:
    return Path(root) / model / LOCK_NAME


@contextmanager
def exclusive(path: str | os.PathLike[str], purpose: str) -> Iterator[None]:
    """Hold an exclusive lock on `path` or raise ConflictError naming the holder."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(p, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            if not isinstance(e, BlockingIOError):
                raise UserError(
                    f"cannot lock {p}: {e.strerror}; on Lustre mount with `-o flock` (the cluster's fstab does) "
                    "so that one node at a time changes these checkpoints",
                    exit_code=3,
                ) from None
            holder = ""
            try:
                holder = os.pread(fd, 4096, 0).decode(errors="replace").strip()
                info = json.loads(holder)
                holder = f"pid {info.get('pid')} on {info.get('host')} ({info.get('purpose')}, since {info.get('since')})"
            except (OSError, ValueError):
                pass
            raise ConflictError(
                f"{p} is locked by another process{': ' + holder if holder else ''}; "
                "only one node may change these checkpoints at a time — wait for it to finish and re-run"
            ) from None
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
