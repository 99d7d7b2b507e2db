"""Retention's delete journal: `<root>/<model>/.retention-journal/<name>.deleting`.

Retention writes an entry before it removes a checkpoint's marker and drops it after the data
is gone, so a run killed in between is finished by the next run instead of leaving a
directory without a marker forever. An entry must never outlive a new save or a restore of
that name (it would mark the new checkpoint for deletion): the writer and restore drop it
while they hold the checkpoint's lock (lock.checkpoint_lock), and retention re-checks it under
the same lock before it acts.
"""
from __future__ import annotations

import os
import time
from datetime import datetime, timezone
from pathlib import Path

from tiered_ckpt.io import fsafe
from tiered_ckpt.io.commit import fsync_dir

JOURNAL_DIR = ".retention-journal"
SUFFIX = ".deleting"


def journal_dir(root: str | os.PathLike[str], model: str) -> Path:
    return Path(root) / model / JOURNAL_DIR


def entry_path(root: str | os.PathLike[str], model: str, name: str) -> Path:
    return journal_dir(root, model) / f"{name}{SUFFIX}"


def journaled(root: str | os.PathLike[str], model: str) -> set[str]:
    d = journal_dir(root, model)
    if not fsafe.is_real_dir(d):
        return set()
    return {e.name[: -len(SUFFIX)] for e in os.scandir(d) if e.name.endswith(SUFFIX)}


def forget(root: str | os.PathLike[str], model: str, name: str) -> None:
    """Drop the journal entry of `name` (a new save or a restore of that name is under way)."""
    if fsafe.unlink(entry_path(root, model, name), anchor=root):
        fsync_dir(journal_dir(root, model))


def add(root: str | os.PathLike[str], model: str, name: str) -> Path:
    """Record that `name` is about to be deleted (fsynced before the marker goes)."""
    d = journal_dir(root, model)
    os.close(fsafe.make_dirs(d, anchor=root))
    p = entry_path(root, model, name)
    fsafe.write_file(p, time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()).encode(), anchor=root)
    fsync_dir(d)
    return p


# Restore records: `<root>/<model>/.restored/<name>` holds the UTC time of the last restore of
# that checkpoint. Retention keeps a checkpoint restored within retention.restore_grace whatever
# its rules say: a user who restores an old checkpoint gets to use it before the next run.
RESTORED_DIR = ".restored"


def restored_dir(root: str | os.PathLike[str], model: str) -> Path:
    return Path(root) / model / RESTORED_DIR


def note_restored(root: str | os.PathLike[str], model: str, name: str) -> None:
    d = restored_dir(root, model)
    os.close(fsafe.make_dirs(d, anchor=root))   # a symlink or file planted there is refused
    fsafe.write_file(d / name, datetime.now(timezone.utc).isoformat().encode(), anchor=root)
    fsync_dir(d)


def restored(root: str | os.PathLike[str], model: str) -> dict[str, datetime]:
    """Checkpoint name -> when it was last restored (unreadable records are ignored)."""
    d = restored_dir(root, model)
    out: dict[str, datetime] = {}
    if not fsafe.is_real_dir(d):
        return out
    for e in os.scandir(d):
        try:
            t = datetime.fromisoformat(fsafe.read_file(Path(e.path), anchor=root, limit=200).decode())
        except (OSError, ValueError, UnicodeDecodeError):
            continue
        out[e.name] = t if t.tzinfo else t.replace(tzinfo=timezone.utc)
    return out


def forget_restored(root: str | os.PathLike[str], model: str, name: str) -> None:
    if fsafe.unlink(restored_dir(root, model) / name, anchor=root):
        fsync_dir(restored_dir(root, model))
