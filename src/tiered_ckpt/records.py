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

import fcntl
import json
import logging
import os
import stat
import time
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

SAVE, ASYNC_SAVE, RETENTION, RESTORE = "save", "async_save", "retention", "restore"
KINDS = (SAVE, ASYNC_SAVE, RETENTION, RESTORE)
HISTORY, HISTORY_OLD = "history.jsonl", "history.1.jsonl"
HISTORY_LIMIT = 8 << 20     # bytes; a save's line is ~200 bytes, so tens of thousands of operations


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
    data = _read_regular(records_dir(root, model) / f"{kind}.json", 1 << 20)
    if data is None:
        return None
    try:
        got = json.loads(data)
    except ValueError:
        return None
    return got if isinstance(got, dict) else None


def record(root: str | os.PathLike[str], model: str, kind: str, fields: dict[str, Any],
           totals: dict[str, float] | None = None) -> None:
    """Replace the last record of `kind` with `fields` (+ time), adding `totals` to the running totals."""
    if kind not in KINDS:
        raise ValueError(f"unknown record kind {kind!r}")
    d = records_dir(root, model)
    try:
        d.mkdir(parents=True, exist_ok=True)
        lock = os.open(d / f".{kind}.lock", os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o664)
        try:
            fcntl.flock(lock, fcntl.LOCK_EX)
            old = read(root, model, kind) or {}
            sums = dict(old.get("totals") or {})
            for k, v in (totals or {}).items():
                sums[k] = float(sums.get(k, 0)) + float(v)
            now = time.time()
            body = json.dumps({**fields, "time_unix": now, "totals": sums}, sort_keys=True).encode()
            tmp = d / f".{kind}.{os.getpid()}.tmp"
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o664)
            try:
                os.write(fd, body)
            finally:
                os.close(fd)
            os.replace(tmp, d / f"{kind}.json")
        finally:
            os.close(lock)
        _append_history(d, {**fields, "kind": kind, "time_unix": now})
    except OSError as e:
        log.warning("could not record the %s of model %s under %s: %s", kind, model, d, e)


def _append_history(d: Path, entry: dict[str, Any]) -> None:
    line = json.dumps(entry, sort_keys=True).encode() + b"\n"
    lock = os.open(d / ".history.lock", os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o664)
    try:
        fcntl.flock(lock, fcntl.LOCK_EX)      # one writer at a time: lines never interleave, rotation is safe
        p = d / HISTORY
        try:
            if os.lstat(p).st_size + len(line) > HISTORY_LIMIT:
                os.replace(p, d / HISTORY_OLD)
        except FileNotFoundError:
            pass
        fd = os.open(p, os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW | os.O_CLOEXEC, 0o664)
        try:
            size = os.fstat(fd).st_size
            # A writer killed mid-line left no newline: start a new line, or this record would be
            # glued to the torn one and be unreadable too.
            if size and os.pread(fd, 1, size - 1) != b"\n":
                line = b"\n" + line
            os.write(fd, line)
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
