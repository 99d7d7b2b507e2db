"""Operation records: the last outcome of each kind of operation of a model, for metrics.

A save, a retention apply and a restore each leave one small JSON record (the last one of its kind,
plus running totals) that `tiered-ckpt metrics` turns into Prometheus samples. Records live next to
the checkpoint root, not inside it (`<parent>/.<root name>.records/<model>/<kind>.json`), like the
local exporter's status file: outside the tree AMLFS exports, so they never reach the archive, and
they survive a wipe of the tree. Written whole and renamed into place (a reader never sees half a
record), totals updated under an flock so that concurrent writers add up. Recording is best effort:
a record that cannot be written never fails the operation it describes (a warning is logged).

Each record is also appended, as one JSON line, to the model's history (`history.jsonl`, for
`tiered-ckpt timeline`): the last record says what happened last, the history what happened
when. The history is bounded: past HISTORY_LIMIT bytes it becomes `history.1.jsonl` (the older
one is dropped), so a node that saves for months keeps at most twice that.
"""
from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import stat
import time
from pathlib import Path
from typing import Any

from tiered_ckpt.io import fsafe

log = logging.getLogger(__name__)

SAVE, ASYNC_SAVE, RETENTION, RESTORE = "save", "async_save", "retention", "restore"
MEMORY = "memory"           # a save into the memory tier (tiered_ckpt.memory_tier), once its replica ended
KINDS = (SAVE, ASYNC_SAVE, RETENTION, RESTORE, MEMORY)
HISTORY, HISTORY_OLD = "history.jsonl", "history.1.jsonl"
HISTORY_LIMIT = 8 << 20     # bytes; a save's line is ~200 bytes, so tens of thousands of operations
LOCK_WAIT = 5.0             # seconds a writer waits for a records lock before it skips its record


def records_dir(root: str | os.PathLike[str], model: str) -> Path:
    r = Path(root).resolve()
    return r.parent / f".{r.name}.records" / model


def _read_regular(p: Path, limit: int) -> bytes | None:
    """The bytes of a regular file (no symlink followed, no FIFO opened blocking), None if absent."""
    try:
        fd = os.open(p, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        chunks, left = [], limit
        while left > 0:
            b = os.read(fd, min(left, 1 << 20))
            if not b:
                break
            chunks.append(b)
            left -= len(b)
        return b"".join(chunks)
    finally:
        os.close(fd)


def read(root: str | os.PathLike[str], model: str, kind: str) -> dict[str, Any] | None:
    """The last record of `kind`, or None (none yet, or unreadable: metrics then leave it out)."""
    got, _ = read_checked(root, model, kind)
    return got


def read_checked(root: str | os.PathLike[str], model: str, kind: str) -> tuple[dict[str, Any] | None, bool]:
    """(the last record of `kind` or None, whether a file is there that is not a record)."""
    data = _read_regular(records_dir(root, model) / f"{kind}.json", 1 << 20)
    if data is None:
        return None, False
    try:
        got = json.loads(data)
    except ValueError:
        return None, True
    return (got, False) if isinstance(got, dict) else (None, True)


def record(root: str | os.PathLike[str], model: str, kind: str, fields: dict[str, Any],
           totals: dict[str, float] | None = None) -> None:
    """Replace the last record of `kind` with `fields` (+ time), adding `totals` to the running totals."""
    if kind not in KINDS:
        raise ValueError(f"unknown record kind {kind!r}")
    d = records_dir(root, model)
    try:
        d.mkdir(parents=True, exist_ok=True)
        # Every file here is opened through fsafe.open_own: a FIFO, symlink or hard link planted
        # at one of these names is replaced, never opened (a FIFO would hang the save after its commit).
        lock = fsafe.open_own(d / f".{kind}.lock", os.O_RDWR, fsafe.LOCK_MODE)
        try:
            _flock(lock, d / f".{kind}.lock")
            old = read(root, model, kind) or {}
            sums = dict(old.get("totals") or {})
            for k, v in (totals or {}).items():
                sums[k] = float(sums.get(k, 0)) + float(v)
            now = time.time()
            body = json.dumps({**fields, "time_unix": now, "totals": sums}, sort_keys=True).encode()
            fsafe.replace_own(d / f"{kind}.json", body, 0o664, planted_ok=True)
        finally:
            os.close(lock)
        _append_history(d, {**fields, "kind": kind, "time_unix": now})
    except OSError as e:
        log.warning("could not record the %s of model %s under %s: %s", kind, model, d, e)


def _flock(fd: int, path: Path) -> None:
    """The records lock, waited for at most LOCK_WAIT seconds: a writer stopped while holding it
    (SIGSTOP, a hung file system) costs the others one record, never their save, restore or
    retention run (recording is best effort)."""
    deadline = time.monotonic() + LOCK_WAIT
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            if time.monotonic() >= deadline:
                raise OSError(errno.ETIMEDOUT, f"held by another process for over {LOCK_WAIT:g} s", str(path)) from None
            time.sleep(0.02)


def _append_history(d: Path, entry: dict[str, Any]) -> None:
    line = json.dumps(entry, sort_keys=True).encode() + b"\n"
    lock = fsafe.open_own(d / ".history.lock", os.O_RDWR, fsafe.LOCK_MODE)
    try:
        _flock(lock, d / ".history.lock")   # one writer at a time: lines never interleave, rotation is safe
        p = d / HISTORY
        try:
            if os.lstat(p).st_size + len(line) > HISTORY_LIMIT:
                os.replace(p, d / HISTORY_OLD)
        except FileNotFoundError:
            pass
        fd = fsafe.open_own(p, os.O_RDWR | os.O_APPEND, 0o664)
        try:
            size = os.fstat(fd).st_size
            # A writer killed mid-line left no newline: start a new line, or this record would be
            # glued to the torn one and be unreadable too.
            if size and os.pread(fd, 1, size - 1) != b"\n":
                line = b"\n" + line
            fsafe.write_all(fd, line)
        finally:
            os.close(fd)
    finally:
        os.close(lock)


def history(root: str | os.PathLike[str], model: str) -> list[dict[str, Any]]:
    """Every record still in the history, oldest first (unreadable lines are skipped)."""
    d = records_dir(root, model)
    out: list[dict[str, Any]] = []
    for name in (HISTORY_OLD, HISTORY):
        data = _read_regular(d / name, 2 * HISTORY_LIMIT)
        for line in (data or b"").splitlines():
            try:
                got = json.loads(line)
            except ValueError:
                continue                # a line cut short by a crash mid-write
            if isinstance(got, dict) and isinstance(got.get("time_unix"), (int, float)):
                out.append(got)
    return out
