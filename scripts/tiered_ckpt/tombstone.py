"""Tombstones: `<root>/<model>/.archived/<name>` records that retention deleted checkpoint
`name` from the accelerator layer while the archive still holds it.

A name that is gone locally may still be committed in the archive; a new save of that name
must not look like a fresh start (it would be a second generation beside the archived one).
Retention writes the tombstone before it removes the marker; restore clears it once the
checkpoint is back. The record holds the marker's save id (when it has one) and a hash of the
marker, so whoever reads it can tell which generation the archive holds.
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import TYPE_CHECKING

from . import fsafe
from .hashing import new_hasher

if TYPE_CHECKING:
    from .manifest import Manifest

TOMBSTONES = ".archived"


def _dir(root: str | os.PathLike[str], model: str) -> Path:
    return Path(root) / model / TOMBSTONES


def path(root: str | os.PathLike[str], model: str, name: str) -> Path:
    return _dir(root, model) / name


def _fsync_dir(d: Path) -> None:
    fd = os.open(d, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def record(root: str | os.PathLike[str], model: str, name: str, manifest: Manifest) -> None:
    """Note that `name` (this marker) now lives only in the archive; fsynced."""
    d = _dir(root, model)
    if not fsafe.is_real_dir(d):
        try:
            os.mkdir(d, 0o755)
        except FileExistsError:
            pass
        # A symlink or file planted at .archived is refused by the write below (anchor=root).
    h = new_hasher()
    h.update(manifest.to_json())
    data = {"name": name, "save_id": getattr(manifest, "save_id", None), "marker_xxh3_128": h.hexdigest()}
    fsafe.write_file(path(root, model, name), json.dumps(data, sort_keys=True).encode(), anchor=root)
    _fsync_dir(d)


def present(root: str | os.PathLike[str], model: str, name: str) -> bool:
    return fsafe.is_regular(path(root, model, name))


def clear(root: str | os.PathLike[str], model: str, name: str) -> None:
    """Drop the tombstone (the checkpoint is back on the accelerator layer)."""
    if fsafe.unlink(path(root, model, name), anchor=root):
        _fsync_dir(_dir(root, model))
