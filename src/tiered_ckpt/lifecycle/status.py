"""`tiered-ckpt status`: where each checkpoint lives, the export backlog, the export job,
and the accelerator layer's capacity against what retention will keep.

Tier states: resident (on the accelerator layer, archive state unknown), not yet archived,
archived (resident and proven archived), released (AMLFS: data freed, names kept), only in
archive (committed in Blob, absent here), in flight (not committed), invalid (a marker that
is not valid: not committed, the detail says why), being deleted.

Status tells the truth about what it could check. Each part (markers, lfs, archive, backlog,
export, capacity) is a `Check`: ok, UNKNOWN (it could not be checked: lfs failed, ARM refused,
the container is unreachable or refused the credential; the reason says which) or PROBLEM
(it was checked and something is wrong). A part that is UNKNOWN shows no numbers (the backlog
is null, not 0). `Status.exit_code()` turns that into the command's exit code (errors.py):

* 0 (EXIT_OK): every part was checked and none has a problem;
* 1 (EXIT_FAILED): a problem was found (even if other parts are also UNKNOWN);
* 3 (EXIT_UNAVAILABLE): no problem found, but some part is UNKNOWN; like a monitoring plugin's
  UNKNOWN (3), so an alert fires on "could not check" as well as on "checked and bad".
"""
from __future__ import annotations

import logging
import os
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from tiered_ckpt import records
from tiered_ckpt.errors import EXIT_FAILED, EXIT_OK, EXIT_UNAVAILABLE, UserError
from tiered_ckpt.io import commit, mounts
from tiered_ckpt.lifecycle.exporter import Exporter, default_status_path, read_status, walk_tree
from tiered_ckpt.lifecycle.journal import journaled
from tiered_ckpt.lifecycle.policy import Policy, decide
from tiered_ckpt.lifecycle.proof import CheckpointProof, prove
from tiered_ckpt.lifecycle.restore import archive_committed
from tiered_ckpt.lifecycle.retention import candidates_from
from tiered_ckpt.logs import fields
from tiered_ckpt.naming import CheckpointId, parse_name
from tiered_ckpt.tiers.backends import TierBackend, make_jobs
from tiered_ckpt.tiers.blob import BlobInfo

log = logging.getLogger(__name__)

OK, UNKNOWN, PROBLEM = "ok", "UNKNOWN", "PROBLEM"
# The parts status checks, in the order it reports them.
PARTS = ("markers", "lfs", "archive", "backlog", "export", "capacity", "locking", "records")
# Export job states that mean new checkpoints are not being archived (AMLFS auto-export job
# status, Microsoft.StorageCache autoExportJobs; the local exporter uses the same words).
EXPORT_STOPPED = ("Failed", "DisableFailed", "Disabled", "Disabling")


@dataclass
class Check:
    part: str
    state: str            # OK | UNKNOWN | PROBLEM
    reason: str = ""


@dataclass
class CheckpointStatus:
    name: str
    tier: str
    bytes: int
    detail: str = ""


@dataclass
class Backlog:
    files: int | None = 0           # None: unknown (the check's reason says why)
    bytes: int | None = 0
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
    checks: list[Check] = field(default_factory=list)

    def check(self, part: str, state: str, reason: str = "") -> None:
        """Record the outcome of `part`; a worse one replaces a better one (PROBLEM > UNKNOWN > OK)."""
        rank = {OK: 0, UNKNOWN: 1, PROBLEM: 2}
        for i, c in enumerate(self.checks):
            if c.part == part:
                if rank[state] > rank[c.state]:
                    self.checks[i] = Check(part, state, reason)
                elif rank[state] == rank[c.state] and reason and reason not in c.reason:
                    c.reason = f"{c.reason}; {reason}" if c.reason else reason
                return
        self.checks.append(Check(part, state, reason))
        self.checks.sort(key=lambda c: PARTS.index(c.part) if c.part in PARTS else len(PARTS))

    def state_of(self, part: str) -> str:
        return next((c.state for c in self.checks if c.part == part), OK)

    def known(self, part: str) -> bool:
        return self.state_of(part) != UNKNOWN

    @property
    def health(self) -> str:
        """healthy | problems | unknown (problems first: a found problem is the stronger fact)."""
        states = {c.state for c in self.checks}
        return "problems" if PROBLEM in states else "unknown" if UNKNOWN in states else "healthy"

    def exit_code(self) -> int:
        return {"healthy": EXIT_OK, "problems": EXIT_FAILED, "unknown": EXIT_UNAVAILABLE}[self.health]

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "health": self.health, "exit_code": self.exit_code()}


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
        where = export_status_path or default_status_path(cfg.root)
        st = read_status(where)
        if st is None:
            return {"job": "local exporter (stand-in for AMLFS auto-export)", "state": "never ran",
                    "status_file": str(where), "hint": "run `tiered-ckpt export --watch` (or the demo)"}
        return {"job": st.stand_in, **asdict(st)}
    try:
        s = make_jobs(cfg).autoexport_status()
    except UserError as e:
        return {"job": "AMLFS auto-export", "state": "unknown", "error": str(e)}
    d = asdict(s) if hasattr(s, "__dataclass_fields__") else dict(vars(s))
    return {"job": "AMLFS auto-export", **d}


def export_check(export: Mapping[str, Any]) -> tuple[str, str]:
    """(state, reason) of the export job from what `export_job` read."""
    state = export.get("state")
    if export.get("error"):
        return UNKNOWN, f"{export.get('job')}: {export['error']}"
    if state == "never ran":
        return UNKNOWN, f"{export.get('job')} never ran (no status file {export.get('status_file')}); {export.get('hint')}"
    if state in EXPORT_STOPPED:
        msg = export.get("status_message") or ""
        return PROBLEM, (f"{export.get('job')} is {state}{': ' + msg if msg else ''}; new checkpoints are not "
                         "archived (a restore's import job disables auto-export while it runs)")
    last = export.get("last_iteration") or {}
    failed = export.get("current_iteration_files_failed") or (last.get("files_failed") if isinstance(last, dict) else 0)
    if isinstance(failed, int) and failed > 0:
        return PROBLEM, f"{export.get('job')}: {failed} file(s) failed in the current/last iteration"
    return OK, ""


def records_problem(root: str | os.PathLike[str], model: str) -> str | None:
    """Why saves, retention and restores cannot leave their records (metrics, timeline), or None.

    The records live next to the root (records.records_dir), in a directory the writers create
    if they may; under a root-owned mount root they may not, so the node boot creates it
    group-shared (2775). Checked for this user: the nearest existing directory on the way to the
    model's records must be writable (then the rest can be created)."""
    d = records.records_dir(root, model)
    base = d.parent
    fix = f"create it group-shared like the root (install -d -m 2775 -g $(stat -c %g {root}) {base}; the node boot does)"
    p = d
    while not p.exists() and p != p.parent:
        p = p.parent
    if not p.is_dir():
        return f"records directory {base}: {p} is not a directory; metrics and timeline stay empty: {fix}"
    if not os.access(p, os.W_OK | os.X_OK):
        if p in (d, base):
            return (f"records directory {p} is not writable by this user (uid {os.getuid()}); metrics and timeline "
                    f"miss what this user's saves, retention runs and restores do: make it group-writable (2775) "
                    "and add the user to its group")
        return (f"records directory {base} does not exist and cannot be created here ({p} is not writable by uid "
                f"{os.getuid()}); every save, retention run and restore skips its record, so metrics and timeline "
                f"stay empty: {fix}")
    return None


def capacity(root: str, keeps: int, next_bytes: int) -> Capacity:
    v = os.statvfs(root)
    total = v.f_blocks * v.f_frsize
    free = v.f_bavail * v.f_frsize
    used = total - v.f_bfree * v.f_frsize
    needed = keeps + next_bytes
    return Capacity(total, used, free, keeps, next_bytes, needed, needed <= total)


def gather(backend: TierBackend, policy: Policy | None = None,
           export_status_path: str | os.PathLike[str] | None = None) -> Status:
    """The model's status; every part that could not be checked is UNKNOWN with its reason.

    Raises UserError only when the root itself is not usable (nothing could be said at all).
    """
    started = time.monotonic()
    cfg = backend.cfg
    commit.require_root(cfg.root)
    policy = policy or Policy.from_config(cfg.retention)
    out = Status(cfg.model, backend.kind, str(cfg.root))
    infos = commit.scan(cfg.root, cfg.model, cfg.naming)
    amlfs = backend.kind == "amlfs"      # the tier has HSM: proof and backlog ask lfs
    # One listing of the model's blobs serves the proof, the archive-only checkpoints and the
    # backlog: on a large model each listing is many pages, and an unreachable archive would
    # otherwise be retried (with backoff) once per use.
    blobs: dict[str, BlobInfo] | None = None
    archive_err: UserError | None = None
    if backend.archive_configured:
        try:
            blobs = backend.store.listing(cfg.model)
            out.check("archive", OK)
        except UserError as e:
            archive_err = e
            out.check("archive", UNKNOWN, f"the archive could not be listed: {e}")
    else:
        out.check("archive", OK, "not configured: proof by lfs hsm_state alone")
    proofs: dict[str, CheckpointProof] = {}
    proof_note = "archive state unknown"
    if archive_err is not None:
        proof_note = "archive state unknown: the archive could not be listed"
    else:
        try:
            proofs = prove(backend, infos, blobs)
        except UserError as e:
            # With the listing in hand, the proof's only other dependency is lfs (AMLFS).
            part = "lfs" if amlfs else "archive"
            out.check(part, UNKNOWN, f"archive proof unavailable: {e}")
            proof_note = f"archive state unknown: {part} could not be checked"
    pending = journaled(cfg.root, cfg.model)
    invalid: list[str] = []
    for c in infos:
        if not c.committed:
            if c.name in pending:
                tier = "being deleted"
            elif c.invalid is not None:
                tier = "invalid"           # a marker is there, but it does not count: why says so
                invalid.append(f"{c.name} ({c.why_not_committed or 'invalid marker'})")
            else:
                tier = "in flight"
            out.checkpoints.append(CheckpointStatus(c.name, tier, 0, c.why_not_committed or "not committed"))
            continue
        assert c.manifest is not None
        p = proofs.get(c.name)
        if p is None:
            tier, detail = "resident", proof_note
        elif p.released:
            tier, detail = "released", "data in the archive; names kept (restore: hsm_restore)"
        elif p.archived:
            tier, detail = "archived", "resident and proven archived"
        else:
            tier, detail = "not yet archived", p.blocked_reason()
        out.checkpoints.append(CheckpointStatus(c.name, tier, c.manifest.total_bytes, detail))
    out.check("markers", PROBLEM if invalid else OK,
              f"{len(invalid)} invalid marker(s): {', '.join(invalid[:3])}" if invalid else "")
    local_names = {c.name for c in infos if c.committed}
    if blobs is not None:
        try:
            for m in archive_committed(backend.store, cfg.model, blobs, cfg.naming):
                if m.name not in local_names:
                    out.checkpoints.append(CheckpointStatus(m.name, "only in archive", m.total_bytes,
                                                            "restore: download (local) / import job (AMLFS)"))
        except UserError as e:
            out.check("archive", UNKNOWN, f"the archive's markers could not be read: {e}")
    out.checkpoints.sort(key=lambda s: parse_name(s.name, cfg.naming) or CheckpointId(0, 0))
    try:
        if archive_err is not None and not amlfs:
            # Local mode measures the backlog against the archive.
            raise UserError("measured against the archive, which could not be listed (see archive)")
        out.backlog = backlog(backend, commit.model_dir(cfg.root, cfg.model), blobs)
        if out.backlog.note:
            out.check("backlog", PROBLEM, out.backlog.note)
        else:
            out.check("backlog", OK)
        if amlfs:
            out.check("lfs", OK)
    except UserError as e:
        # AMLFS measures the backlog with lfs hsm_state alone; local mode against the archive.
        out.backlog = Backlog(None, None, None, f"unknown: {e}")
        out.check("backlog", UNKNOWN, str(e))
        if amlfs:
            out.check("lfs", UNKNOWN, f"lfs hsm_state failed: {e}")
    out.export = export_job(backend, export_status_path)
    out.check("export", *export_check(out.export))
    decisions = decide(candidates_from(infos, proofs, pending), policy, datetime.now(timezone.utc))
    keeps = sum(d.bytes for d in decisions if d.action not in ("delete", "resume-delete", "release"))
    done = [c for c in infos if c.committed]
    next_bytes = done[-1].manifest.total_bytes if done and done[-1].manifest else 0
    try:
        out.capacity = capacity(str(cfg.root), keeps, next_bytes)
    except OSError as e:
        out.check("capacity", UNKNOWN, f"statvfs of {cfg.root} failed: {e.strerror or e}")
    else:
        if not out.capacity.fits:
            out.check("capacity", PROBLEM,
                      f"retention keeps {keeps} bytes and the next checkpoint needs {next_bytes}: more than the "
                      f"accelerator layer's {out.capacity.total_bytes} bytes; lower retention.keep_last or grow the "
                      "file system")
        else:
            out.check("capacity", OK)
    problem = mounts.flock_problem(cfg.root)
    out.check("locking", PROBLEM if problem else OK, problem or "")
    problem = records_problem(cfg.root, cfg.model)
    out.check("records", PROBLEM if problem else OK, problem or "")
    bad = [chk for chk in out.checks if chk.state != OK]
    out.warnings.extend(f"{chk.part}: {chk.state}: {chk.reason}" for chk in bad)
    log.info("status of %s: %s%s", cfg.model, out.health, "".join(f"; {chk.part} {chk.state}" for chk in bad),
             extra=fields("status", model=cfg.model, duration_s=time.monotonic() - started, outcome=out.health,
                          unknown=[chk.part for chk in bad if chk.state == UNKNOWN],
                          problems=[chk.part for chk in bad if chk.state == PROBLEM]))
    return out
