"""POSIX helpers of the writer: data files (O_DIRECT where allowed), small files, directories.

Nothing is followed through a symlink: the model and checkpoint directories are verified
real directories (a symlink is refused, never written into), kept open, and every file is
created relative to that descriptor with O_CREAT|O_EXCL|O_NOFOLLOW and explicit modes
(directories fsafe.DIR_MODE 2775, files 0644, whatever the umask). `os_error` turns an OSError into one
UserError naming the path and the fix.
"""
from __future__ import annotations

import errno
import json
import os
from pathlib import Path
from typing import Any

from tiered_ckpt.errors import EXIT_CONFLICT, UserError
from tiered_ckpt.io import fsafe

# O_DIRECT's alignment of file offsets, lengths and buffer addresses: the logical block size, at most
# the 4 KiB page on the file systems we write (open(2), "O_DIRECT"). Every aligned size in io/ uses it.
ALIGN = 4096

_SMALL_LIMIT = 256 << 20       # part manifests and notes: far larger than any real one

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC | getattr(os, "O_NOFOLLOW", 0)

def open_data(dfd: int, name: str, path: Path, direct: bool) -> tuple[int, bool]:
    """Create a data file under its final name in the directory `dfd`; O_DIRECT where the file
    system allows it. O_EXCL: the name is unique to this save, so anything already there (a
    planted symlink, FIFO or hard link included) is refused, never followed or truncated."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | getattr(os, "O_NOFOLLOW", 0)
    fd = -1
    if direct and hasattr(os, "O_DIRECT"):
        try:
            fd = os.open(name, flags | os.O_DIRECT, 0o644, dir_fd=dfd)
        except OSError as e:
            if e.errno != errno.EINVAL:   # tmpfs and some FUSE mounts refuse O_DIRECT
                raise os_error(e, path) from None
    used_direct = fd >= 0
    if fd < 0:
        try:
            fd = os.open(name, flags, 0o644, dir_fd=dfd)
        except OSError as e:
            raise os_error(e, path) from None
    try:
        os.fchmod(fd, 0o644)   # explicit: a umask of 000 must not widen it
    except OSError as e:
        os.close(fd)
        raise os_error(e, path) from None
    return fd, used_direct


def pwrite_all(fd: int, view: memoryview, offset: int) -> None:
    while view:
        n = os.pwrite(fd, view, offset)
        if n <= 0:
            raise OSError(errno.EIO, "short write")
        view, offset = view[n:], offset + n


def os_error(e: OSError, path: str | os.PathLike[str]) -> UserError:
    p = Path(path)
    if isinstance(e, fsafe.UnsafePath):
        return UserError(f"{e.filename or p}: {e.strerror}; remove it (it is not the toolkit's) or choose another "
                         "--root; the checkpoint was not committed", exit_code=EXIT_CONFLICT)
    if e.errno == errno.EEXIST:
        return UserError(f"{p} already exists: something else created a file under a name that is unique to this save; "
                         "remove it and save again; the checkpoint was not committed", exit_code=EXIT_CONFLICT)
    if e.errno in (errno.ENOSPC, errno.EDQUOT):
        return UserError(f"no space left writing {p} ({e.strerror}); free space on that file system "
                         "(tiered-ckpt retention) or choose another --root; the checkpoint was not committed")
    if e.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        return UserError(f"cannot write {p} ({e.strerror}); check the permissions or mount of {p.parent} "
                         "or choose another --root; the checkpoint was not committed")
    if e.errno == errno.EFBIG:
        return UserError(f"file too large writing {p} ({e.strerror}); raise the file size limit (ulimit -f) "
                         "or use more --files; the checkpoint was not committed")
    if e.errno in (errno.ENOENT, errno.ENOTDIR):
        return UserError(f"{p.parent} disappeared while writing ({e.strerror}); check the mount; the checkpoint was not committed")
    if e.errno == errno.ELOOP:
        return UserError(f"{p} is a symbolic link; refused (never followed); remove it; the checkpoint was not committed",
                         exit_code=EXIT_CONFLICT)
    return UserError(f"writing {p} failed: {e.strerror or e} (errno {e.errno}); the checkpoint was not committed")


def write_small(dfd: int, name: str, data: bytes) -> None:
    """A small new file (part manifest, failure note) under its final name in `dfd`, fsynced."""
    fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | getattr(os, "O_NOFOLLOW", 0), 0o644,
                 dir_fd=dfd)
    try:
        os.fchmod(fd, 0o644)
        pwrite_all(fd, memoryview(data), 0)
        os.fsync(fd)
    finally:
        os.close(fd)


def read_small(dfd: int, name: str, limit: int = _SMALL_LIMIT) -> bytes | None:
    """A small regular file of the directory `dfd` (None if absent, not regular, or over `limit`)."""
    try:
        fd = fsafe.open_file(name, dir_fd=dfd)
    except OSError:
        return None
    try:
        return fsafe.read_fd(fd, limit)
    except OSError:
        return None
    finally:
        os.close(fd)


def json_at(dfd: int, name: str) -> dict[str, Any] | None:
    data = read_small(dfd, name)
    if data is None:
        return None
    try:
        d = json.loads(data)
    except ValueError:
        return None
    return d if isinstance(d, dict) else None



def open_subdir(parent_fd: int, name: str, path: Path, create: bool) -> tuple[int, bool]:
    """(fd, created) of the real directory `name` in `parent_fd`, made fsafe.DIR_MODE if `create` and missing.

    A symlink (or anything not a directory) there is refused, never followed. The new entry is
    made durable by the commit (it fsyncs the model directory and the root before the marker)."""
    created = False
    if create:
        try:
            os.mkdir(name, fsafe.DIR_MODE, dir_fd=parent_fd)
            created = True
        except FileExistsError:
            pass
    try:
        fd = os.open(name, _DIR_FLAGS, dir_fd=parent_fd)
    except OSError as e:
        if e.errno in (errno.ELOOP, errno.ENOTDIR):
            try:
                what = fsafe.kind(os.lstat(name, dir_fd=parent_fd).st_mode)
            except OSError:
                what = "not a directory"
            raise UserError(f"{path} is {what}, not a directory; refused (a save never writes through a symlink "
                            "nor deletes anything it points at): remove it, or choose another --root/model",
                            exit_code=EXIT_CONFLICT) from None
        raise
    if created:
        try:
            os.fchmod(fd, fsafe.DIR_MODE)   # explicit: the umask must not decide (fsafe.DIR_MODE says why)
        except BaseException:
            os.close(fd)
            raise
    return fd, created



def fsync_parents(root: Path, mdir: Path) -> None:
    """fsync the model directory (below `root`, no symlink followed) and the root itself: the
    directory entries a save created are durable before its marker is written."""
    mfd = fsafe.open_dir(mdir, anchor=root)
    try:
        os.fsync(mfd)
    finally:
        os.close(mfd)
    rfd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(rfd)
    finally:
        os.close(rfd)
