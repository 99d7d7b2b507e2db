"""Operation records: the last outcome of each kind of operation of a model, for metrics.

A save, a retention apply and a restore each leave one small JSON record (the last one of its kind,
plus running totals) that `tiered-ckpt metrics` turns into Prometheus samples. Records live next to
the checkpoint root, not inside it (`<parent>/.<root name>.records/<model>/<kind>.json`), like the
local exporter's status file: outside the tree AMLFS exports, so they never reach the archive, and
they survive a wipe of the tree. Written whole and renamed into place (a reader never sees half a
record), totals updated under an flock so that concurrent writers add up. Recording is best effort:
a record that cannot be written never fails the operation it describes (a warning is logged).
"""
from __future__ import annotations

import fcntl
import json
import logging
import os
import time
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

SAVE, ASYNC_SAVE, RETENTION, RESTORE = "save", "async_save", "retention", "restore"
KINDS = (SAVE, ASYNC_SAVE, RETENTION, RESTORE)


def records_dir(root: str | os.PathLike[str], model: str) -> Path:
    r = Path(root).resolve()
    return r.parent / f".{r.name}.records" / model


def read(root: str | os.PathLike[str], model: str, kind: str) -> dict[str, Any] | None:
    """The last record of `kind`, or None (none yet, or unreadable: metrics then leave it out)."""
    p = records_dir(root, model) / f"{kind}.json"
    try:
        fd = os.open(p, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        if not __import__("stat").S_ISREG(os.fstat(fd).st_mode):
            return None
        data = os.read(fd, 1 << 20)
    finally:
        os.close(fd)
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
            body = json.dumps({**fields, "time_unix": time.time(), "totals": sums}, sort_keys=True).encode()
            tmp = d / f".{kind}.{os.getpid()}.tmp"
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o664)
            try:
                os.write(fd, body)
            finally:
                os.close(fd)
            os.replace(tmp, d / f"{kind}.json")
        finally:
            os.close(lock)
    except OSError as e:
        log.warning("could not record the %s of model %s under %s: %s", kind, model, d, e)
