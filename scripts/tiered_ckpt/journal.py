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
from pathlib import Path

from . import fsafe
from .manifest import fsync_dir

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
    if not fsafe.is_real_dir(d):
        os.mkdir(d, 0o755)
    p = entry_path(root, model, name)
    fsafe.write_file(p, time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()).encode(), anchor=root)
    fsync_dir(d)
    return p
