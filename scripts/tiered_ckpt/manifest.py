"""The commit protocol: the manifest is the commit marker, and it is written last.

AMLFS auto-export copies new and changed files but never propagates renames, moves or
deletes to Blob. So nothing here renames: every data file is written under its final name,
fsynced, and only then is ``COMMITTED.json`` created (O_EXCL, final name, fsynced together
with its directory). A checkpoint is committed if and only if its marker parses and names
every file with the right size. A torn marker (crash mid-write) does not parse, so the
checkpoint simply is not committed. On delete the marker goes first, so a crash halfway
never leaves a directory that looks committed. There is no "latest" pointer: the newest
committed checkpoint is found by scanning markers.
"""
from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from .errors import ConflictError, UserError
from .hashing import ALGORITHM
from .naming import CheckpointId, parse_name

MARKER = "COMMITTED.json"
FORMAT = "tiered-ckpt/1"


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
        return json.dumps(d, indent=1, sort_keys=True).encode()

    @classmethod
    def from_json(cls, data: bytes | str) -> Manifest:
        """Parse a marker; raises ValueError for anything that is not a complete manifest."""
        try:
            d = json.loads(data)
            if not isinstance(d, dict) or d.get("format") != FORMAT:
                raise ValueError("not a tiered-ckpt manifest")
            files = [FileEntry(**f) for f in d.pop("files")]
            for f in files:
                if f.size < 0 or f.path.startswith("/") or ".." in f.path.split("/"):
                    raise ValueError(f"bad file entry {f.path!r}")
            return cls(files=files, **d)
        except (TypeError, KeyError, json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ValueError(f"unparseable manifest: {e}") from e


def fsync_dir(path: str | os.PathLike[str]) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_marker(ckpt_dir: str | os.PathLike[str], manifest: Manifest) -> Path:
    """Create the commit marker under its final name. Data files must already be fsynced.

    Refuses to overwrite an existing marker: a committed checkpoint is never rewritten.
    """
    path = Path(ckpt_dir) / MARKER
    data = manifest.to_json()
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
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
    fsync_dir(ckpt_dir)
    return path


def read_marker(ckpt_dir: str | os.PathLike[str]) -> Manifest | None:
    """The manifest if the marker exists and parses, else None."""
    try:
        data = (Path(ckpt_dir) / MARKER).read_bytes()
    except (FileNotFoundError, NotADirectoryError, IsADirectoryError):
        return None
    try:
        return Manifest.from_json(data)
    except ValueError:
        return None


def size_problems(ckpt_dir: str | os.PathLike[str], manifest: Manifest) -> list[str]:
    """Files named by the manifest that are missing or have the wrong size."""
    problems = []
    for f in manifest.files:
        p = Path(ckpt_dir) / f.path
        try:
            size = p.stat().st_size
        except FileNotFoundError:
            problems.append(f"{p}: missing")
            continue
        if size != f.size:
            problems.append(f"{p}: {size} bytes, manifest says {f.size}")
    return problems


@dataclass(frozen=True)
class CheckpointInfo:
    """One checkpoint directory found on the accelerator layer."""

    model: str
    id: CheckpointId
    path: Path
    manifest: Manifest | None    # set only when committed (marker parses and sizes match)

    @property
    def name(self) -> str:
        return self.id.name

    @property
    def committed(self) -> bool:
        return self.manifest is not None


def inspect(model: str, path: Path, cid: CheckpointId) -> CheckpointInfo:
    m = read_marker(path)
    if m is not None and (m.id != cid or size_problems(path, m)):
        m = None
    return CheckpointInfo(model, cid, path, m)


def model_dir(root: str | os.PathLike[str], model: str) -> Path:
    return Path(root) / model


def scan(root: str | os.PathLike[str], model: str) -> list[CheckpointInfo]:
    """Every checkpoint directory of a model, committed or not, oldest first."""
    d = model_dir(root, model)
    if not d.is_dir():
        return []
    found = []
    for entry in os.scandir(d):
        cid = parse_name(entry.name)
        if cid is not None and entry.is_dir(follow_symlinks=False):
            found.append(inspect(model, Path(entry.path), cid))
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


def remove_checkpoint(path: str | os.PathLike[str]) -> None:
    """Delete a checkpoint directory, marker first. Idempotent; safe to re-run after a kill."""
    p = Path(path)
    try:
        (p / MARKER).unlink()
    except FileNotFoundError:
        pass
    else:
        fsync_dir(p)
    if p.exists():
        shutil.rmtree(p)


def require_root(root: str | os.PathLike[str], setting: str = "--root") -> Path:
    p = Path(root)
    if not p.is_dir():
        raise UserError(
            f"checkpoint root {p} does not exist or is not a directory ({setting}); "
            "create it, mount the file system, or pass another --root"
        )
    return p
