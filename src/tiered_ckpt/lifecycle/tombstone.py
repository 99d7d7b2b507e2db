"""Names whose checkpoint was archived and then deleted locally: `<root>/<model>/.archived/<name>`.

Retention deletes a checkpoint from the accelerator layer only once every file is proven
archived; the name stays committed in the archive. A later save of that name must be refused
(its marker in Blob is the committed copy; the same name with other content on the other tier
would be two checkpoints with one name). The writer checks the archive itself where one is
configured (an unreachable one refuses the save unless the caller passed
archive_check="best_effort"); this local record answers without the network. Retention records it (`record`) before it deletes;
the writer refuses a name that is `present`; `clear` is for an operator (or a tool) that has
deleted the archived copy too and wants the name back.

The file holds the deleted marker's save id and the xxh3-128 of its canonical JSON
(`Manifest.to_json`), so the archived copy it stands for can be told from a later one. It
lives under a dot-name, which the exporter never archives, and is written through fsafe: a
planted symlink is refused, never followed.
"""
from __future__ import annotations

import json
import os
import time
from pathlib import Path

from tiered_ckpt.errors import EXIT_CONFLICT, UserError
from tiered_ckpt.io import fsafe
from tiered_ckpt.io.hashing import new_hasher
from tiered_ckpt.io.marker import Manifest

TOMBSTONES = ".archived"


def tombstone_dir(root: str | os.PathLike[str], model: str) -> Path:
    return Path(root) / model / TOMBSTONES


def tombstone_path(root: str | os.PathLike[str], model: str, name: str) -> Path:
    return tombstone_dir(root, model) / name


def _dir_fd(root: str | os.PathLike[str], model: str, create: bool) -> int | None:
    """A descriptor of the tombstone directory (None if it does not exist and create is False)."""
    d = tombstone_dir(root, model)
    try:
        return fsafe.open_dir(d, anchor=root)
    except FileNotFoundError:
        if not create:
            return None
    except fsafe.UnsafePath as e:
        raise UserError(f"{d}: {e.strerror}; remove it (someone planted it there) and re-run", exit_code=EXIT_CONFLICT) from None
    mfd = fsafe.open_dir(d.parent, anchor=root)
    try:
        try:
            os.mkdir(TOMBSTONES, fsafe.DIR_MODE, dir_fd=mfd)
        except FileExistsError:
            pass
        fd = fsafe.open_dir(d, anchor=root)
        os.fchmod(fd, fsafe.DIR_MODE)      # explicit: the umask must not decide (fsafe.DIR_MODE)
        os.fsync(mfd)
        return fd
    finally:
        os.close(mfd)


def record(root: str | os.PathLike[str], model: str, name: str, manifest: Manifest) -> Path:
    """Remember that `name` (this manifest) is archived and about to be deleted locally; fsynced."""
    h = new_hasher()
    h.update(manifest.to_json())
    info = {"name": name, "save_id": manifest.save_id, "marker_xxh3_128": h.hexdigest(),
            "created_utc": manifest.created_utc,
            "recorded_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    fd = _dir_fd(root, model, create=True)
    assert fd is not None
    try:
        p = tombstone_path(root, model, name)
        fsafe.write_file(p, json.dumps(info, sort_keys=True).encode(), anchor=root)
        os.fsync(fd)
        return p
    finally:
        os.close(fd)


def present(root: str | os.PathLike[str], model: str, name: str) -> bool:
    """Whether `name` was archived and deleted locally (any entry of that name counts: refusing
    is the safe answer for a file someone planted)."""
    fd = _dir_fd(root, model, create=False)
    if fd is None:
        return False
    try:
        os.lstat(name, dir_fd=fd)
        return True
    except FileNotFoundError:
        return False
    finally:
        os.close(fd)


def clear(root: str | os.PathLike[str], model: str, name: str) -> None:
    """Forget the record of `name` (its archived copy is gone too)."""
    if fsafe.unlink(tombstone_path(root, model, name), anchor=root):
        fd = _dir_fd(root, model, create=False)
        if fd is not None:
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
