"""Opening things inside the shared checkpoint tree without being redirected.

The checkpoint tree is shared (Lustre): any user who can write to it can plant a symlink,
a FIFO, a device node or a hard link where the toolkit expects one of its own files. Run as
root (the retention timer), following such a file would let it redirect a write, a delete or
a truncate anywhere on the node; opening a FIFO would hang the command. So every open under
the tree goes through here:

* every path component below a trusted anchor (the configured checkpoint root) is opened
  with ``O_NOFOLLOW | O_DIRECTORY`` relative to its parent's descriptor (openat(2)), so a
  directory swapped for a symlink is refused, not followed;
* the file itself is opened ``O_NOFOLLOW | O_NONBLOCK`` (open(2): a FIFO opened non-blocking
  returns at once instead of waiting for a writer) and accepted only if ``fstat`` says it is
  a regular file (and, for files we write or truncate, has one link: a hard link planted by
  another user would otherwise let a truncate reach its target).

The anchor itself is trusted (an operator may mount or link the root where they like).
Refusals raise ``UnsafePath`` (an OSError) naming the path and what it is instead.
"""
from __future__ import annotations

import errno
import os
import stat
import threading
from pathlib import Path

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_NONBLOCK = getattr(os, "O_NONBLOCK", 0)
_WRITE_MASK = os.O_WRONLY | os.O_RDWR | os.O_TRUNC


# Modes of what the toolkit creates in the tree, always set explicitly (fchmod), so that the process
# umask (000 is common in containers) never decides. Directories are group-writable and setgid:
# the training users and the retention service user share the tree's group (the node bootstrap
# makes the root 2775, group tiered-ckpt), and every new entry keeps that group. Nothing is
# world-writable. Lock files are opened read-write by every actor, so they are group-writable too.
DIR_MODE = 0o2775
FILE_MODE = 0o644
LOCK_MODE = 0o664


class UnsafePath(OSError):
    """A path in the checkpoint tree is a symlink, a FIFO, a device, a hard link or outside the tree."""


def kind(mode: int) -> str:
    """What a file of this st_mode is, in words (for messages)."""
    if stat.S_ISLNK(mode):
        return "a symbolic link"
    if stat.S_ISFIFO(mode):
        return "a FIFO"
    if stat.S_ISSOCK(mode):
        return "a socket"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "a device node"
    if stat.S_ISDIR(mode):
        return "a directory"
    return "not a regular file"


def _refuse(path: str | os.PathLike[str], what: str) -> UnsafePath:
    return UnsafePath(errno.ELOOP if "symbolic link" in what else errno.EINVAL, f"{what}, refused (never followed or opened)", str(path))


def _components(path: Path, anchor: Path | None) -> tuple[Path, tuple[str, ...]]:
    """(anchor, parts below it) for path; without an anchor only the last component is checked."""
    if anchor is None:
        return path.parent, (path.name,)
    try:
        rel = path.relative_to(anchor)
    except ValueError:
        raise UnsafePath(errno.EXDEV, f"outside the checkpoint root {anchor}", str(path)) from None
    parts = tuple(p for p in rel.parts if p not in ("", "."))
    if ".." in parts:
        raise UnsafePath(errno.EXDEV, "has '..' in it", str(path))
    return anchor, parts


def _open_dirs(base: Path, parts: tuple[str, ...], full: Path) -> int:
    """fd of base/parts[0]/..., each component a real directory (no symlink followed)."""
    fd = os.open(base, _DIR_FLAGS)
    try:
        for p in parts:
            try:
                nfd = os.open(p, _DIR_FLAGS | _NOFOLLOW, dir_fd=fd)
            except OSError as e:
                if e.errno in (errno.ELOOP, errno.ENOTDIR):
                    try:
                        st = os.lstat(p, dir_fd=fd)
                        what = kind(st.st_mode)
                    except OSError:
                        what = "not a directory"
                    raise _refuse(full, f"{what} where a directory was expected") from None
                raise
            os.close(fd)
            fd = nfd
    except BaseException:
        os.close(fd)
        raise
    return fd


def open_dir(path: str | os.PathLike[str], *, anchor: str | os.PathLike[str] | None = None) -> int:
    """A descriptor of directory `path`; no component below `anchor` may be a symlink."""
    p = Path(path)
    a = Path(anchor) if anchor is not None else None
    if a is not None and p == a:
        return os.open(p, _DIR_FLAGS)
    base, parts = _components(p, a)
    return _open_dirs(base, parts, p)


def make_dirs(path: str | os.PathLike[str], *, anchor: str | os.PathLike[str]) -> int:
    """A descriptor of directory `path`, creating missing components below `anchor` (DIR_MODE).

    No component below the anchor may be a symlink or a non-directory (UnsafePath otherwise).
    """
    p, a = Path(path), Path(anchor)
    _, parts = _components(p, a)
    fd = os.open(a, _DIR_FLAGS)
    try:
        for i, part in enumerate(parts):
            created = False
            try:
                os.mkdir(part, DIR_MODE, dir_fd=fd)
                created = True
            except FileExistsError:
                pass
            nfd = _open_dirs_at(fd, part, a.joinpath(*parts[: i + 1]))
            os.close(fd)
            fd = nfd
            if created:
                os.fchmod(fd, DIR_MODE)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _open_dirs_at(fd: int, part: str, full: Path) -> int:
    try:
        return os.open(part, _DIR_FLAGS | _NOFOLLOW, dir_fd=fd)
    except OSError as e:
        if e.errno in (errno.ELOOP, errno.ENOTDIR):
            try:
                what = kind(os.lstat(part, dir_fd=fd).st_mode)
            except OSError:
                what = "not a directory"
            raise _refuse(full, f"{what} where a directory was expected") from None
        raise


def is_real_dir(path: str | os.PathLike[str]) -> bool:
    """A directory and not a symlink to one."""
    try:
        return stat.S_ISDIR(os.lstat(path).st_mode)
    except OSError:
        return False


def open_file(path: str | os.PathLike[str], flags: int = os.O_RDONLY, mode: int = 0o644, *,
              anchor: str | os.PathLike[str] | None = None, dir_fd: int | None = None) -> int:
    """Open a regular file in the tree (see the module doc); UnsafePath for anything else.

    `dir_fd`: open `path` (a single name) relative to that directory descriptor instead.
    """
    p = Path(path)
    own_fd = dir_fd is None
    if dir_fd is None:
        base, parts = _components(p, Path(anchor) if anchor is not None else None)
        dir_fd = _open_dirs(base, parts[:-1], p)
        name = parts[-1] if parts else p.name
    else:
        name = p.name
    try:
        try:
            fd = os.open(name, flags | _NOFOLLOW | _NONBLOCK | os.O_CLOEXEC, mode, dir_fd=dir_fd)
        except OSError as e:
            if e.errno in (errno.ELOOP, errno.ENXIO, errno.EWOULDBLOCK):
                try:
                    what = kind(os.lstat(name, dir_fd=dir_fd).st_mode)
                except OSError:
                    what = "not a regular file"
                raise _refuse(p, what) from None
            raise
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise _refuse(p, kind(st.st_mode))
            if flags & _WRITE_MASK and st.st_nlink > 1:
                raise _refuse(p, f"a file with {st.st_nlink} hard links")
            if _NONBLOCK:
                os.set_blocking(fd, True)
        except BaseException:
            os.close(fd)
            raise
        return fd
    finally:
        if own_fd:
            os.close(dir_fd)


def read_fd(fd: int, limit: int | None = None, path: str | os.PathLike[str] = "") -> bytes:
    """Everything from an open file; more than `limit` bytes raises UnsafePath (EFBIG): a planted
    file must not make a reader allocate without bound."""
    chunks: list[bytes] = []
    total = 0
    while True:
        b = os.read(fd, 1 << 20)
        if not b:
            return b"".join(chunks)
        total += len(b)
        if limit is not None and total > limit:
            raise UnsafePath(errno.EFBIG, f"larger than {limit} bytes", str(path))
        chunks.append(b)


def read_file(path: str | os.PathLike[str], *, anchor: str | os.PathLike[str] | None = None,
              limit: int | None = None) -> bytes:
    """The whole content of a regular file (at most `limit` bytes: more raises UnsafePath)."""
    fd = open_file(path, anchor=anchor)
    try:
        return read_fd(fd, limit, path)
    finally:
        os.close(fd)


def write_all(fd: int, data: bytes) -> None:
    """Write every byte (os.write may write fewer than asked)."""
    view = memoryview(data)
    while view:
        n = os.write(fd, view)
        view = view[n:]


def write_file(path: str | os.PathLike[str], data: bytes, *, mode: int = 0o644, exclusive: bool = False,
               anchor: str | os.PathLike[str] | None = None) -> None:
    """Create (or, unless exclusive, replace the content of) a small regular file, fsynced."""
    flags = os.O_WRONLY | os.O_CREAT | (os.O_EXCL if exclusive else os.O_TRUNC)
    fd = open_file(path, flags, mode, anchor=anchor)
    try:
        os.fchmod(fd, mode)   # explicit: the process umask (000 seen in containers) must not widen it
        write_all(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)


def unlink(path: str | os.PathLike[str], *, anchor: str | os.PathLike[str] | None = None,
           missing_ok: bool = True) -> bool:
    """Remove one non-directory entry without following a symlinked parent; True if removed."""
    p = Path(path)
    base, parts = _components(p, Path(anchor) if anchor is not None else None)
    try:
        dfd = _open_dirs(base, parts[:-1], p)
    except FileNotFoundError:
        if missing_ok:
            return False
        raise
    try:
        os.unlink(parts[-1] if parts else p.name, dir_fd=dfd)
        return True
    except FileNotFoundError:
        if missing_ok:
            return False
        raise
    finally:
        os.close(dfd)


# Writing files the toolkit owns outside the checkpoint tree (records, the metrics textfile):
# the directory is shared too, so whatever is planted at one of our names (a FIFO, a symlink, a
# hard link) is unlinked (unlink(2) never follows) and the name created afresh. A FIFO opened
# for writing would block until a reader comes (fifo(7)); a FIFO held open by a reader would
# take a write and block once its pipe is full.
def open_own(path: str | os.PathLike[str], flags: int, mode: int, *, dir_fd: int | None = None) -> int:
    """open_file for writing at a name of ours (module doc above): a regular file with one link,
    created with `mode` (fchmod: the umask never decides) if absent; anything else there is
    replaced. `flags` must hold O_CREAT and a write mode."""
    for _ in range(8):        # another writer may replace the same planted entry meanwhile
        try:
            fd = open_file(path, flags | os.O_CREAT | os.O_EXCL, mode, dir_fd=dir_fd)
            try:
                os.fchmod(fd, mode)
            except BaseException:
                os.close(fd)
                raise
            return fd
        except FileExistsError:
            pass
        try:
            return open_file(path, flags & ~os.O_CREAT, mode, dir_fd=dir_fd)
        except FileNotFoundError:
            continue
        except UnsafePath:
            name = Path(path) if dir_fd is None else Path(path).name
            try:
                os.unlink(name, dir_fd=dir_fd)
            except FileNotFoundError:
                pass
    raise UnsafePath(errno.EAGAIN, "kept being replaced by something else than a regular file", str(path))


def replace_own(path: str | os.PathLike[str], data: bytes, mode: int = FILE_MODE, *, planted_ok: bool = False) -> None:
    """Replace a small file of ours atomically (a temporary name next to it, fsynced, renamed):
    a reader sees the old or the new content, never half. Outside the checkpoint tree only
    (AMLFS export does not propagate renames, DESIGN.md). Something other than a regular file at
    `path` (a device such as /dev/full given as the path, a FIFO, a symlink) is refused
    (UnsafePath), unless `planted_ok` (a directory only the toolkit writes: replaced)."""
    p = Path(path)
    if not planted_ok:
        try:
            st = os.lstat(p)
        except FileNotFoundError:
            pass
        else:
            if not stat.S_ISREG(st.st_mode):
                raise _refuse(p, kind(st.st_mode))
    tmp = p.with_name(f".{p.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    try:
        fd = open_own(tmp, os.O_WRONLY | os.O_TRUNC, mode)
    except OSError as e:
        e.filename = str(tmp)       # the whole path in the user's message, not the name under its directory
        raise
    try:
        os.ftruncate(fd, 0)
        write_all(fd, data)
        os.fsync(fd)
    except BaseException as e:
        os.close(fd)
        unlink(tmp)
        if isinstance(e, OSError):
            e.filename = str(tmp)
        raise
    os.close(fd)
    os.replace(tmp, p)
