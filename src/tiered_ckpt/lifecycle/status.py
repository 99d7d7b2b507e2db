"""`tiered-ckpt status`: where each checkpoint lives, the export backlog, the export job,
and the accelerator layer's capacity against what retention will keep.

Tier states: resident (on the accelerator layer, archive state unknown), not yet archived,
archived (resident and proven archived), released (AMLFS: data freed, names kept), only in
archive (committed in Blob, absent here), in flight (not committed), invalid (a marker that
is not valid: not committed, the detail says why), being deleted.
"""
from __future__ import annotations

import os
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from tiered_ckpt.errors import UserError
from tiered_ckpt.io import commit as mf
from tiered_ckpt.lifecycle.exporter import Exporter, default_status_path, read_status, walk_tree
from tiered_ckpt.lifecycle.journal import journaled
from tiered_ckpt.lifecycle.policy import Policy, decide
from tiered_ckpt.lifecycle.proof import CheckpointProof, prove
from tiered_ckpt.lifecycle.restore import archive_committed
from tiered_ckpt.lifecycle.retention import candidates_from
from tiered_ckpt.naming import CheckpointId, parse_name
from tiered_ckpt.tiers.backends import TierBackend, make_jobs
from tiered_ckpt.tiers.blob import BlobInfo


@dataclass
class CheckpointStatus:
    name: str
    tier: str
    bytes: int
    detail: str = ""


@dataclass
class Backlog:
    files: int = 0
    bytes: int = 0
    oldest_age_s: float | None = None
    note: str = ""


@dataclass
class Capacity:
    total_bytes: int
    used_bytes: int
    free_bytes: int
    retention_keeps_bytes: int      # what retention will keep on this tier (kept + blocked + in flight)
    next_checkpoint_bytes: int      # the newest committed checkpoint's size
    needed_bytes: int               # keeps + one more checkpoint
    fits: bool


@dataclass
class Status:
    model: str
    backend: str
    root: str
    checkpoints: list[CheckpointStatus] = field(default_factory=list)
    backlog: Backlog = field(default_factory=Backlog)
    export: dict[str, Any] = field(default_factory=dict)
    capacity: Capacity | None = None
    warnings: list[str] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def backlog(backend: TierBackend, model_dir: Path, listing: Mapping[str, BlobInfo] | None = None) -> Backlog:
    """Files under the model directory not yet in the archive (committed or not).

    `listing`: the model's blobs when the caller has listed them already.
    """
    under, unreadable = walk_tree(model_dir)
    note = f"{len(unreadable)} path(s) could not be read (first: {unreadable[0]})" if unreadable else ""
    if not under:
        return Backlog(note=note)
    files = {str(model_dir / rel): st for rel, st in under.items()}
    pending: list[str] = []
    hsm = backend.hsm_states(list(files))
    if hsm is not None:
        states, errors = hsm
        pending = [p for p in files if p in errors or not states[p].archived]
    else:
        blobs = backend.store.listing(model_dir.name) if listing is None else listing
        pending = [str(model_dir / rel) for rel, st in under.items()
                   if Exporter.changed(st, blobs.get(f"{model_dir.name}/{rel}"))]
    now = time.time()
    oldest = min((files[p].st_mtime for p in pending), default=None)
    return Backlog(len(pending), sum(files[p].st_size for p in pending), None if oldest is None else round(now - oldest, 1),
                   note)


def export_job(backend: TierBackend, export_status_path: str | os.PathLike[str] | None) -> dict[str, Any]:
    cfg = backend.cfg
    if backend.kind == "local":
        st = read_status(export_status_path or default_status_path(cfg.root))
        if st is None:
            return {"job": "local exporter (stand-in for AMLFS auto-export)", "state": "never ran",
                    "hint": "run `tiered-ckpt export --watch` (or the demo)"}
        return {"job": st.stand_in, **asdict(st)}
    try:
        s = make_jobs(cfg).autoexport_status()
    except UserError as e:
        return {"job": "AMLFS auto-export", "state": "unknown", "error": str(e)}
    d = asdict(s) if hasattr(s, "__dataclass_fields__") else dict(vars(s))
    return {"job": "AMLFS auto-export", **d}


def capacity(root: str, keeps: int, next_bytes: int) -> Capacity:
    v = os.statvfs(root)
    total = v.f_blocks * v.f_frsize
    free = v.f_bavail * v.f_frsize
    used = total - v.f_bfree * v.f_frsize
    needed = keeps + next_bytes
    return Capacity(total, used, free, keeps, next_bytes, needed, needed <= total)


def gather(backend: TierBackend, policy: Policy | None = None,
           export_status_path: str | os.PathLike[str] | None = None) -> Status:
    cfg = backend.cfg
    mf.require_root(cfg.root)
    policy = policy or Policy.from_config(cfg.retention)
    out = Status(cfg.model, backend.kind, str(cfg.root))
    infos = mf.scan(cfg.root, cfg.model, cfg.naming)
    # One listing of the model's blobs serves the proof, the archive-only checkpoints and the
    # backlog: on a large model each listing is many pages, and an unreachable archive would
    # otherwise be retried (with backoff) once per use.
    blobs: dict[str, BlobInfo] | None = None
    archive_err: UserError | None = None
    if backend.archive_configured:
        try:
            blobs = backend.store.listing(cfg.model)
        except UserError as e:
            archive_err = e
    proofs: dict[str, CheckpointProof] = {}
    try:
        if archive_err is not None:
            raise archive_err
        proofs = prove(backend, infos, blobs)
    except UserError as e:
        out.warnings.append(f"archive proof unavailable: {e}")
    pending = journaled(cfg.root, cfg.model)
    for c in infos:
        if not c.committed:
            if c.name in pending:
                tier = "being deleted"
            elif c.invalid is not None:
                tier = "invalid"           # a marker is there, but it does not count: why says so
            else:
                tier = "in flight"
            out.checkpoints.append(CheckpointStatus(c.name, tier, 0, c.why_not_committed or "not committed"))
            continue
        assert c.manifest is not None
        p = proofs.get(c.name)
        if p is None:
            tier, detail = "resident", "archive state unknown"
        elif p.released:
            tier, detail = "released", "data in the archive; names kept (restore: hsm_restore)"
        elif p.archived:
            tier, detail = "archived", "resident and proven archived"
        else:
            tier, detail = "not yet archived", p.blocked_reason()
        out.checkpoints.append(CheckpointStatus(c.name, tier, c.manifest.total_bytes, detail))
    local_names = {c.name for c in infos if c.committed}
    if blobs is not None:
        try:
            for m in archive_committed(backend.store, cfg.model, blobs, cfg.naming):
                if m.name not in local_names:
                    out.checkpoints.append(CheckpointStatus(m.name, "only in archive", m.total_bytes,
                                                            "restore: download (local) / import job (AMLFS)"))
        except UserError as e:
            out.warnings.append(f"archive listing unavailable: {e}")
    out.checkpoints.sort(key=lambda s: parse_name(s.name, cfg.naming) or CheckpointId(0, 0))
    try:
        if archive_err is not None and backend.kind == "local":
            raise archive_err       # local mode measures the backlog against the archive
        out.backlog = backlog(backend, mf.model_dir(cfg.root, cfg.model), blobs)
    except UserError as e:
        out.backlog = Backlog(note=f"unknown: {e}")
    out.export = export_job(backend, export_status_path)
    decisions = decide(candidates_from(infos, proofs, pending), policy, datetime.now(timezone.utc))
    keeps = sum(d.bytes for d in decisions if d.action not in ("delete", "resume-delete", "release"))
    done = [c for c in infos if c.committed]
    next_bytes = done[-1].manifest.total_bytes if done and done[-1].manifest else 0
    out.capacity = capacity(str(cfg.root), keeps, next_bytes)
    if not out.capacity.fits:
        out.warnings.append(
            f"retention keeps {keeps} bytes and the next checkpoint needs {next_bytes}: more than the "
            f"accelerator layer's {out.capacity.total_bytes} bytes; lower retention.keep_last or grow the file system"
        )
    return out
