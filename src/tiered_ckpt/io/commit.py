"""The commit protocol: the manifest is the commit marker, and it is written last.

AMLFS auto-export copies new and changed files but never propagates renames, moves or
deletes to Blob. So nothing here renames: every data file is written under its final name,
fsynced, and only then is ``COMMITTED.json`` created (O_EXCL, final name, fsynced together
with its directory). A checkpoint is committed if and only if its marker is valid (see
io/marker.py: a strict schema) and names every file with the right size. A torn marker
(crash mid-write) does not parse, so the checkpoint simply is not committed. On delete the
marker goes first, so a crash halfway never leaves a directory that looks committed. There
is no "latest" pointer: the newest committed checkpoint is found by scanning markers.

The checkpoint tree is shared: a marker may be malformed or hostile (a FIFO, a directory, a
path with NUL or '..', an index pointing at a file it does not list). Each such marker makes
its one checkpoint "not committed (invalid marker: why)"; nothing here raises for it or
blocks on it (every open goes through fsafe: regular files only, never a symlink, O_NONBLOCK).
"""
from __future__ import annotations

import errno
import os
import shutil
import stat
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from tiered_ckpt.errors import ConflictError, UserError
from tiered_ckpt.io import fsafe

# The marker's format is io/marker.py's (its users import it from there); this module is what a save
# and a scan do with it.
from tiered_ckpt.io.marker import (
    MARKER,
    MAX_MARKER_BYTES,
    InvalidMarker,
    Manifest,
    parse_marker,
)
from tiered_ckpt.naming import DEFAULT as DEFAULT_NAMING
from tiered_ckpt.naming import CheckpointId, parse_in

__all__ = ["CheckpointInfo", "committed", "find", "fsync_dir", "inspect", "latest_committed", "marker_bytes", "model_dir", "read_marker", "read_marker_checked", "remove_checkpoint", "require_root", "scan", "size_problems", "write_marker"]


# -- the marker on disk -------------------------------------------------------------------------

def fsync_dir(path: str | os.PathLike[str]) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_marker(ckpt_dir: str | os.PathLike[str], manifest: Manifest, *, dir_fd: int | None = None) -> Path:
    """Create the commit marker under its final name. Data files must already be fsynced.

    Refuses to overwrite an existing marker: a committed checkpoint is never rewritten.
    `dir_fd`: the checkpoint directory already opened (and verified) by the caller; the marker is
    created relative to it, so a directory swapped for a symlink meanwhile cannot redirect it.
    """
    path = Path(ckpt_dir) / MARKER
    data = manifest.to_json()
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | getattr(os, "O_NOFOLLOW", 0)
    try:
        fd = os.open(MARKER, flags, fsafe.FILE_MODE, dir_fd=dir_fd) if dir_fd is not None else os.open(path, flags, fsafe.FILE_MODE)
    except FileExistsError:
        raise ConflictError(
            f"{path} already exists: checkpoint {manifest.name} is already committed; "
            "choose another name (epoch/step) — committed checkpoints are never overwritten"
        ) from None
    try:
        os.fchmod(fd, fsafe.FILE_MODE)   # explicit: a umask of 077 must not hide it from retention and readers
        fsafe.write_all(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)
    if dir_fd is not None:
        os.fsync(dir_fd)
    else:
        fsync_dir(ckpt_dir)
    return path


def _open_ckpt_dir(ckpt_dir: Path, anchor: str | os.PathLike[str] | None) -> int:
    """fd of the checkpoint directory: below `anchor` no symlink is followed; without an
    anchor the directory itself is trusted (the caller named it)."""
    if anchor is not None:
        return fsafe.open_dir(ckpt_dir, anchor=anchor)
    return os.open(ckpt_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)


def _why(e: OSError) -> str:
    if isinstance(e, fsafe.UnsafePath):
        return f"is {e.strerror or e}"
    return f"cannot be read ({e.strerror or e})"


def _read_marker_at(dfd: int, name: str | None) -> tuple[Manifest | None, str | None]:
    try:
        fd = fsafe.open_file(MARKER, dir_fd=dfd)
    except FileNotFoundError:
        return None, None
    except OSError as e:
        return None, f"{MARKER} {_why(e)}"
    try:
        try:
            data = fsafe.read_fd(fd, MAX_MARKER_BYTES)
        except fsafe.UnsafePath:
            raise InvalidMarker(f"{MARKER} is larger than {MAX_MARKER_BYTES} bytes") from None
        return parse_marker(data, name), None
    except InvalidMarker as e:
        return None, str(e)
    except OSError as e:
        return None, f"{MARKER} {_why(e)}"
    finally:
        os.close(fd)


def read_marker_checked(ckpt_dir: str | os.PathLike[str], *,
                        anchor: str | os.PathLike[str] | None = None) -> tuple[Manifest | None, str | None]:
    """(manifest, None) for a valid marker; (None, None) when there is none; (None, why) when
    there is one that is not valid (a torn write, a hostile file, a FIFO, a directory...).

    Never raises for what is in the directory and never blocks on it. `anchor`: the
    checkpoint root, below which no symlink is followed (the directory itself included).
    """
    p = Path(ckpt_dir)
    try:
        dfd = _open_ckpt_dir(p, anchor)
    except (FileNotFoundError, NotADirectoryError):
        return None, None
    except OSError as e:
        return None, f"checkpoint directory {_why(e)}"
    try:
        return _read_marker_at(dfd, p.name)
    finally:
        os.close(dfd)


def marker_bytes(ckpt_dir: str | os.PathLike[str], *, anchor: str | os.PathLike[str] | None = None) -> bytes | None:
    """The marker's bytes as they are now, for callers that keep them as evidence (restore, retention,
    teardown): a regular file, no symlink followed below `anchor`, at most MAX_MARKER_BYTES (the one
    limit every reader applies, so no marker is committed for one command and absent for another).

    None when there is none; OSError when it cannot be read (fsafe.UnsafePath: hostile or too large).
    """
    try:
        return fsafe.read_file(Path(ckpt_dir) / MARKER, anchor=anchor, limit=MAX_MARKER_BYTES)
    except FileNotFoundError:
        return None
    except OSError as e:
        if e.errno == errno.ENOTDIR:
            return None
        raise


def read_marker(ckpt_dir: str | os.PathLike[str], *, anchor: str | os.PathLike[str] | None = None) -> Manifest | None:
    """The manifest if the marker exists and is valid, else None."""
    return read_marker_checked(ckpt_dir, anchor=anchor)[0]


def _size_problems_at(dfd: int, ckpt_dir: Path, manifest: Manifest) -> list[str]:
    problems: list[str] = []
    dirs: dict[str, int] = {"": dfd}       # opened subdirectories, no symlink followed
    try:
        for f in manifest.files:
            p = ckpt_dir / f.path
            parent, _, leaf = f.path.rpartition("/")
            try:
                pfd = dirs.get(parent)
                if pfd is None:
                    try:
                        pfd = fsafe.open_dir(ckpt_dir / parent, anchor=ckpt_dir)
                    except fsafe.UnsafePath:
                        problems.append(f"{p}: missing ({parent} is not a real directory: never followed)")
                        continue
                    dirs[parent] = pfd
                st = os.lstat(leaf, dir_fd=pfd)
            except (FileNotFoundError, NotADirectoryError):
                problems.append(f"{p}: missing")
                continue
            except OSError as e:
                problems.append(f"{p}: {_why(e)}")
                continue
            if not stat.S_ISREG(st.st_mode):     # lstat: a symlink is not its target
                problems.append(f"{p}: {fsafe.kind(st.st_mode)}, not a regular file")
            elif st.st_size != f.size:
                problems.append(f"{p}: {st.st_size} bytes, manifest says {f.size}")
    finally:
        for k, fd in dirs.items():
            if k:
                os.close(fd)
    return problems


def size_problems(ckpt_dir: str | os.PathLike[str], manifest: Manifest, *,
                  anchor: str | os.PathLike[str] | None = None) -> list[str]:
    """Files named by the manifest that are missing, not regular files or of the wrong size."""
    p = Path(ckpt_dir)
    try:
        dfd = _open_ckpt_dir(p, anchor)
    except OSError as e:
        return [f"{p}: " + ("missing" if e.errno in (errno.ENOENT, errno.ENOTDIR) else _why(e))]
    try:
        return _size_problems_at(dfd, p, manifest)
    finally:
        os.close(dfd)


@dataclass(frozen=True)
class CheckpointInfo:
    """One checkpoint directory found on the accelerator layer."""

    model: str
    id: CheckpointId
    path: Path
    manifest: Manifest | None    # set only when committed (marker valid and sizes match)
    invalid: str | None = None   # the marker is there but not valid: why (then not committed)
    problems: tuple[str, ...] = ()   # the marker is valid but files do not match it

    @property
    def name(self) -> str:
        return self.id.name

    @property
    def committed(self) -> bool:
        return self.manifest is not None

    @property
    def why_not_committed(self) -> str | None:
        """One line for a user; None when committed or when there is simply no marker yet."""
        if self.invalid is not None:
            return f"not committed (invalid marker: {self.invalid})"
        if self.problems:
            extra = f" (and {len(self.problems) - 1} more)" if len(self.problems) > 1 else ""
            return f"not committed (files do not match the marker: {self.problems[0]}{extra})"
        return None


def inspect(model: str, path: Path, cid: CheckpointId, *, anchor: str | os.PathLike[str] | None = None) -> CheckpointInfo:
    """The state of one checkpoint directory; never raises for what is inside it."""
    try:
        dfd = _open_ckpt_dir(path, anchor)
    except (FileNotFoundError, NotADirectoryError):
        return CheckpointInfo(model, cid, path, None)
    except OSError as e:
        return CheckpointInfo(model, cid, path, None, invalid=f"checkpoint directory {_why(e)}")
    try:
        m, why = _read_marker_at(dfd, cid.name)
        if m is None:
            return CheckpointInfo(model, cid, path, None, invalid=why)
        problems = _size_problems_at(dfd, path, m)
    finally:
        os.close(dfd)
    if problems:
        return CheckpointInfo(model, cid, path, None, problems=tuple(problems))
    return CheckpointInfo(model, cid, path, m)


def model_dir(root: str | os.PathLike[str], model: str) -> Path:
    return Path(root) / model


def _candidates(root: str | os.PathLike[str], model: str,
                naming: str | None) -> list[tuple[CheckpointId, str]]:
    """(id, name) of every directory of a model that is named as a checkpoint, oldest first;
    nothing read inside them. The root is trusted; below it nothing is followed."""
    d = model_dir(root, model)
    try:
        dfd = fsafe.open_dir(d, anchor=root)
    except OSError:           # missing, a symlink, not a directory, unreadable: no checkpoints here
        return []
    found = []
    try:
        with os.scandir(dfd) as it:
            entries = [(e.name, e.is_dir(follow_symlinks=False)) for e in it]
    finally:
        os.close(dfd)
    for name, is_dir in entries:
        cid = parse_in(name, naming)
        # Only the canonical spelling of this model's scheme: "..._step05" would alias "..._step5".
        if cid is not None and is_dir and cid.name == name:
            found.append((cid, name))
    return sorted(found)


def scan(root: str | os.PathLike[str], model: str, naming: str | None = DEFAULT_NAMING) -> list[CheckpointInfo]:
    """Every checkpoint directory of a model, committed or not, oldest first.

    Directories named in scheme `naming` (the model's `naming:`; None: any built-in scheme) are
    checkpoints; anything else is not one of this model's.
    The root is trusted; below it nothing is followed: a model or checkpoint directory that
    is a symlink is not scanned (it could point anywhere, e.g. at another model's data).
    Each marker is read and its files' sizes checked; no index is read (format 2 markers do not
    hold one).
    """
    d = model_dir(root, model)
    return [inspect(model, d / name, cid, anchor=root) for cid, name in _candidates(root, model, naming)]


def committed(infos: Iterable[CheckpointInfo]) -> list[CheckpointInfo]:
    return [c for c in infos if c.committed]


def latest_committed(root: str | os.PathLike[str], model: str,
                     naming: str = DEFAULT_NAMING) -> CheckpointInfo | None:
    """The newest committed checkpoint: directories newest first by name (epoch, step), stopping
    at the first whose marker is valid and whose files all have their listed sizes. Older
    checkpoints are not read at all, so the cost does not grow with how many are kept."""
    d = model_dir(root, model)
    for cid, name in reversed(_candidates(root, model, naming)):
        info = inspect(model, d / name, cid, anchor=root)
        if info.committed:
            return info
    return None


def find(root: str | os.PathLike[str], model: str, name: str, naming: str = DEFAULT_NAMING) -> CheckpointInfo | None:
    """The checkpoint directory `name` (named in scheme `naming`), committed or not; None if absent."""
    for cid, n in _candidates(root, model, naming):
        if n == name:
            return inspect(model, model_dir(root, model) / n, cid, anchor=root)
    return None


def remove_checkpoint(path: str | os.PathLike[str], *, anchor: str | os.PathLike[str] | None = None) -> None:
    """Delete a checkpoint directory, marker first. Idempotent; safe to re-run after a kill.

    Never through a symlink: a checkpoint directory that is one is refused (fsafe.UnsafePath),
    and with `anchor` (the checkpoint root) no component between it and the directory may be
    one either. shutil.rmtree does not follow symlinks inside the tree and, on Linux, works
    relative to directory descriptors (shutil.rmtree.avoids_symlink_attacks).
    """
    import errno

    from tiered_ckpt.io import fsafe

    p = Path(path)
    if os.path.lexists(p) and not fsafe.is_real_dir(p):
        raise fsafe.UnsafePath(errno.ELOOP, "not a real directory (a symbolic link or a file), refused", str(p))
    if anchor is not None:
        removed = fsafe.unlink(p / MARKER, anchor=anchor)
    else:
        try:
            (p / MARKER).unlink()
            removed = True
        except FileNotFoundError:
            removed = False
    if removed:
        fsync_dir(p)
    if fsafe.is_real_dir(p):
        shutil.rmtree(p)


def require_root(root: str | os.PathLike[str], setting: str = "--root") -> Path:
    p = Path(root)
    if not p.is_dir():
        raise UserError(
            f"checkpoint root {p} does not exist or is not a directory ({setting}); "
            "create it, mount the file system, or pass another --root"
        )
    return p
