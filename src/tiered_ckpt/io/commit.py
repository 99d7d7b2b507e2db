"""The commit protocol: the manifest is the commit marker, and it is written last.

AMLFS auto-export copies new and changed files but never propagates renames, moves or
deletes to Blob. So nothing here renames: every data file is written under its final name,
fsynced, and only then is ``COMMITTED.json`` created (O_EXCL, final name, fsynced together
with its directory). A checkpoint is committed if and only if its marker is valid (see
`parse_marker`: a strict schema) and names every file with the right size. A torn marker
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
import json
import os
import re
import shutil
import stat
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from tiered_ckpt.errors import ConflictError, UserError
from tiered_ckpt.io import fsafe
from tiered_ckpt.io.hashing import ALGORITHM
from tiered_ckpt.io.layout import SAVE_ID as _SAVE_ID
from tiered_ckpt.naming import CheckpointId, parse_name

MARKER = "COMMITTED.json"
FORMAT = "tiered-ckpt/1"
# A marker is small (a few KiB per rank); anything far larger is not one of ours, and reading
# it whole would let a planted file exhaust memory.
MAX_MARKER_BYTES = 256 << 20
_MAX_INT = 2 ** 63 - 1                 # sizes and offsets: what a file offset (off_t) can hold
_NAME_MAX = 255                        # bytes per path component (Linux NAME_MAX, Lustre too)
_PATH_MAX = 4096                       # bytes per path (Linux PATH_MAX)
_HEX = {ALGORITHM: re.compile(r"[0-9a-f]{32}")}        # xxh3-128: 128 bits, lowercase hex
_RANK_KEY = re.compile(r"0|[1-9][0-9]*")
_KEYS = {"epoch", "step", "files", "world_size", "hash_algo", "created_utc", "index", "format", "save_id"}
_REQUIRED = {"epoch", "step", "files", "format"}
_FILE_KEYS = {"path", "size", "hash", "rank"}
_BUFFER_KEYS = {"kind", "dtype", "shape", "nbytes", "segments"}


class InvalidMarker(ValueError):
    """A marker that is not a valid manifest; str(err) says why (one line)."""


@dataclass(frozen=True)
class FileEntry:
    path: str            # relative to the checkpoint directory, '/'-separated
    size: int
    hash: str | None     # hex xxh3-128 of the content, computed inline while writing
    rank: int = 0


@dataclass
class Manifest:
    epoch: int
    step: int
    files: list[FileEntry]
    world_size: int = 1
    hash_algo: str = ALGORITHM
    created_utc: str = field(default_factory=lambda: datetime.now(timezone.utc).isoformat())
    # Writer-owned description of where each saved buffer lives (name -> file, offset, ...).
    index: dict[str, Any] = field(default_factory=dict)
    format: str = FORMAT
    save_id: str | None = None   # which save wrote it (every file name of that save carries it)

    @property
    def id(self) -> CheckpointId:
        return CheckpointId(self.epoch, self.step)

    @property
    def name(self) -> str:
        return self.id.name

    @property
    def total_bytes(self) -> int:
        return sum(f.size for f in self.files)

    def to_json(self) -> bytes:
        d = asdict(self)
        if d["save_id"] is None:
            del d["save_id"]      # byte-compatible with markers of the released version
        return json.dumps(d, indent=1, sort_keys=True).encode()

    @classmethod
    def from_json(cls, data: bytes | str) -> Manifest:
        """Parse and validate a marker; InvalidMarker (a ValueError) says why it is not one."""
        return parse_marker(data)


# -- validation ---------------------------------------------------------------------------------

def _show(v: Any, limit: int = 80) -> str:
    """A value for a message: repr (so NUL, newlines and odd characters are visible), bounded."""
    r = repr(v)
    return r if len(r) <= limit else r[:limit] + "..."


def _int(v: Any, what: str, lo: int = 0) -> int:
    # bool is an int subclass in Python; JSON true/false is not a size or a step.
    if type(v) is not int:
        raise InvalidMarker(f"{what} is {_show(v)}, not an integer")
    if not lo <= v <= _MAX_INT:
        raise InvalidMarker(f"{what} is {v}, outside {lo}..{_MAX_INT}")
    return v


def _str(v: Any, what: str) -> str:
    if not isinstance(v, str):
        raise InvalidMarker(f"{what} is {_show(v)}, not a string")
    return v


def path_problem(p: str) -> str | None:
    """Why `p` is not a safe file path inside a checkpoint directory, or None."""
    if not p:
        return "is empty"
    if "\0" in p:
        return "contains a NUL character"
    try:
        raw = p.encode("utf-8")
    except UnicodeEncodeError:
        return "is not valid UTF-8"
    if len(raw) > _PATH_MAX:
        return f"is {len(raw)} bytes long (more than {_PATH_MAX})"
    if p.startswith("/"):
        return "is absolute (must be relative to the checkpoint directory)"
    parts = p.split("/")
    for c in parts:
        if c in ("", "."):
            return "has an empty or '.' component (not normalized)"
        if c == "..":
            return "has a '..' component (points outside the checkpoint directory)"
        if len(c.encode("utf-8")) > _NAME_MAX:
            return f"has a component of {len(c.encode('utf-8'))} bytes (more than {_NAME_MAX})"
    if parts[0] == MARKER:
        return f"names the marker {MARKER} itself"
    return None


def _file_entry(d: Any, i: int, hash_re: re.Pattern[str], world_size: int) -> FileEntry:
    what = f"files[{i}]"
    if not isinstance(d, dict):
        raise InvalidMarker(f"{what} is {_show(d)}, not a mapping")
    missing, extra = {"path", "size", "hash"} - set(d), set(d) - _FILE_KEYS
    if missing or extra:
        raise InvalidMarker(f"{what} " + (f"lacks {sorted(missing)}" if missing else f"has unknown keys {_show(sorted(extra))}"))
    path = _str(d["path"], f"{what}.path")
    why = path_problem(path)
    if why:
        raise InvalidMarker(f"file path {_show(path)} {why}")
    size = _int(d["size"], f"size of {_show(path)}")
    h = d["hash"]
    if h is not None and not (isinstance(h, str) and hash_re.fullmatch(h)):
        raise InvalidMarker(f"hash of {_show(path)} is {_show(h)}, not null or a {hash_re.pattern} hex digest")
    rank = _int(d.get("rank", 0), f"rank of {_show(path)}")
    if rank >= world_size:
        raise InvalidMarker(f"rank of {_show(path)} is {rank}, but world_size is {world_size}")
    return FileEntry(path, size, h, rank)


def _check_tree(files: list[FileEntry]) -> None:
    """No duplicates, and no listed file is also a directory of another listed file."""
    paths: set[str] = set()
    for f in files:
        if f.path in paths:
            raise InvalidMarker(f"file path {_show(f.path)} is listed twice")
        paths.add(f.path)
    for f in files:
        parts = f.path.split("/")
        for i in range(1, len(parts)):
            d = "/".join(parts[:i])
            if d in paths:
                raise InvalidMarker(f"{_show(d)} is listed as a file and as a directory of {_show(f.path)}")


def _check_buffer(e: Any, where: str, rank: int, files: Mapping[str, FileEntry]) -> None:
    if not isinstance(e, dict):
        raise InvalidMarker(f"{where} is {_show(e)}, not a mapping")
    if set(e) != _BUFFER_KEYS:
        raise InvalidMarker(f"{where} has keys {_show(sorted(e))}, expected {sorted(_BUFFER_KEYS)}")
    _str(e["kind"], f"{where}.kind")
    if e["dtype"] is not None:
        _str(e["dtype"], f"{where}.dtype")
    nbytes = _int(e["nbytes"], f"{where}.nbytes")
    shape = e["shape"]
    if shape is not None:
        if not isinstance(shape, list):
            raise InvalidMarker(f"{where}.shape is {_show(shape)}, not a list or null")
        count = 1
        for k, n in enumerate(shape):
            count *= _int(n, f"{where}.shape[{k}]")
            count = min(count, _MAX_INT + 1)
        # Each element takes a whole number of bytes (>= 1): a shape that disagrees would make
        # load() allocate far more (or less) than the bytes it reads.
        if count > nbytes or (count and nbytes % count) or (not count and nbytes):
            raise InvalidMarker(f"{where}.shape {_show(shape)} does not fit its {nbytes} bytes")
    segs = e["segments"]
    if not isinstance(segs, list):
        raise InvalidMarker(f"{where}.segments is {_show(segs)}, not a list")
    checked: list[tuple[int, int, int, str]] = []
    for k, s in enumerate(segs):
        sw = f"{where}.segments[{k}]"
        if not isinstance(s, list) or len(s) != 4:
            raise InvalidMarker(f"{sw} is {_show(s)}, not [path, file_offset, nbytes, src_offset]")
        path = _str(s[0], f"{sw} path")
        f = files.get(path)
        if f is None:
            raise InvalidMarker(f"{sw} points at {_show(path)}, which the marker does not list")
        if f.rank != rank:
            raise InvalidMarker(f"{sw} points at {_show(path)}, a file of rank {f.rank}")
        off, n, src = (_int(v, f"{sw}[{j}]") for j, v in ((1, s[1]), (2, s[2]), (3, s[3])))
        if off + n > f.size:
            raise InvalidMarker(f"{sw} ends at byte {off + n} of {_show(path)}, which has {f.size}")
        checked.append((src, n, off, path))
    covered = 0
    for src, n, _, _ in sorted(checked):
        if src != covered:
            raise InvalidMarker(f"{where}: segments leave a gap or overlap at byte {min(src, covered)}")
        covered += n
    if covered != nbytes:
        raise InvalidMarker(f"{where}: segments cover {covered} bytes, nbytes says {nbytes}")


def _check_index(index: Any, files: list[FileEntry], world_size: int) -> None:
    if not isinstance(index, dict):
        raise InvalidMarker(f"index is {_show(index)}, not a mapping")
    extra = set(index) - {"save_id", "ranks"}
    if extra:
        raise InvalidMarker(f"index has unknown keys {_show(sorted(extra))}")
    sid = index.get("save_id")
    if sid is not None:
        _str(sid, "index.save_id")
    ranks = index.get("ranks", {})
    if not isinstance(ranks, dict):
        raise InvalidMarker(f"index.ranks is {_show(ranks)}, not a mapping")
    by_path = {f.path: f for f in files}
    for rk, bufs in ranks.items():
        if not _RANK_KEY.fullmatch(rk) or int(rk) >= world_size:
            raise InvalidMarker(f"index.ranks has key {_show(rk)}, not a rank 0..{world_size - 1}")
        if not isinstance(bufs, dict):
            raise InvalidMarker(f"index of rank {rk} is {_show(bufs)}, not a mapping")
        for name, e in bufs.items():
            _check_buffer(e, f"buffer {_show(name)} of rank {rk}", int(rk), by_path)


def _created(v: Any) -> str:
    s = _str(v, "created_utc")
    try:
        if len(s) > 64:
            raise ValueError
        datetime.fromisoformat(s)
    except ValueError:
        raise InvalidMarker(f"created_utc is {_show(s)}, not an ISO-8601 time") from None
    return s


def validate(d: Any) -> Manifest:
    """A Manifest from a decoded marker, or InvalidMarker saying why it is not one.

    Accepts every marker the released writer produced (all of these hold for it); anything
    else that a reader, a restore or retention could trip over or be misled by is refused.
    """
    if not isinstance(d, dict) or d.get("format") != FORMAT:
        raise InvalidMarker(f"not a {FORMAT} manifest")
    missing, extra = _REQUIRED - set(d), set(d) - _KEYS
    if missing:
        raise InvalidMarker(f"lacks {sorted(missing)}")
    if extra:
        raise InvalidMarker(f"has unknown keys {_show(sorted(extra))}")
    epoch, step = _int(d["epoch"], "epoch"), _int(d["step"], "step")
    world_size = _int(d.get("world_size", 1), "world_size", lo=1)
    algo = _str(d.get("hash_algo", ALGORITHM), "hash_algo")
    hash_re = _HEX.get(algo)
    if hash_re is None:
        raise InvalidMarker(f"hash_algo is {_show(algo)}; this version knows {sorted(_HEX)}")
    created = _created(d["created_utc"]) if "created_utc" in d else datetime.now(timezone.utc).isoformat()
    sid = d.get("save_id")
    if sid is not None and not (isinstance(sid, str) and _SAVE_ID.fullmatch(sid)):
        raise InvalidMarker(f"save_id is {_show(sid)}, not null or a name matching {_SAVE_ID.pattern}")
    raw_files = d["files"]
    if not isinstance(raw_files, list):
        raise InvalidMarker(f"files is {_show(raw_files)}, not a list")
    if not raw_files:
        raise InvalidMarker("files is empty (a save always lists at least its part manifest)")
    files = [_file_entry(f, i, hash_re, world_size) for i, f in enumerate(raw_files)]
    _check_tree(files)
    index = d.get("index", {})
    _check_index(index, files, world_size)
    return Manifest(epoch=epoch, step=step, files=files, world_size=world_size, hash_algo=algo,
                    created_utc=created, index=index, save_id=sid)


def parse_marker(data: bytes | str, name: str | None = None) -> Manifest:
    """Validate a marker's bytes (from disk or from Blob); InvalidMarker says why not.

    `name`: the checkpoint directory the marker was found in; its epoch/step must match it.
    """
    try:
        d = json.loads(data)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise InvalidMarker(f"does not parse ({e})") from None
    except RecursionError:
        raise InvalidMarker("does not parse (nested too deeply)") from None
    m = validate(d)
    if name is not None and m.name != name:
        raise InvalidMarker(f"names checkpoint {m.name}, but it is in {_show(name)}")
    return m


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
        fd = os.open(MARKER, flags, 0o644, dir_fd=dir_fd) if dir_fd is not None else os.open(path, flags, 0o644)
    except FileExistsError:
        raise ConflictError(
            f"{path} already exists: checkpoint {manifest.name} is already committed; "
            "choose another name (epoch/step) — committed checkpoints are never overwritten"
        ) from None
    try:
        view = memoryview(data)
        while view:
            n = os.write(fd, view)
            view = view[n:]
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


def _read_limited(fd: int, limit: int, what: str) -> bytes:
    chunks: list[bytes] = []
    total = 0
    while True:
        b = os.read(fd, 1 << 20)
        if not b:
            return b"".join(chunks)
        total += len(b)
        if total > limit:
            raise InvalidMarker(f"{what} is larger than {limit} bytes")
        chunks.append(b)


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
        data = _read_limited(fd, MAX_MARKER_BYTES, MARKER)
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


def read_marker(ckpt_dir: str | os.PathLike[str], *, anchor: str | os.PathLike[str] | None = None) -> Manifest | None:
    """The manifest if the marker exists and is valid, else None."""
    return read_marker_checked(ckpt_dir, anchor=anchor)[0]


def _kind(mode: int) -> str:
    if stat.S_ISLNK(mode):
        return "a symbolic link"
    if stat.S_ISFIFO(mode):
        return "a FIFO"
    if stat.S_ISDIR(mode):
        return "a directory"
    if stat.S_ISSOCK(mode):
        return "a socket"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "a device node"
    return "not a regular file"


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
                problems.append(f"{p}: {_kind(st.st_mode)}, not a regular file")
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


def scan(root: str | os.PathLike[str], model: str) -> list[CheckpointInfo]:
    """Every checkpoint directory of a model, committed or not, oldest first.

    The root is trusted; below it nothing is followed: a model or checkpoint directory that
    is a symlink is not scanned (it could point anywhere, e.g. at another model's data).
    """
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
        cid = parse_name(name)
        # Only the canonical spelling: "..._step05" would alias "..._step5".
        if cid is not None and is_dir and cid.name == name:
            found.append(inspect(model, d / name, cid, anchor=root))
    return sorted(found, key=lambda c: c.id)


def committed(infos: Iterable[CheckpointInfo]) -> list[CheckpointInfo]:
    return [c for c in infos if c.committed]


def latest_committed(root: str | os.PathLike[str], model: str) -> CheckpointInfo | None:
    done = committed(scan(root, model))
    return done[-1] if done else None


def find(root: str | os.PathLike[str], model: str, name: str) -> CheckpointInfo | None:
    for c in scan(root, model):
        if c.name == name:
            return c
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
