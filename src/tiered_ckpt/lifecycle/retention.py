"""Retention: the I/O around the pure policy (policy.py): gather candidates, apply under locks.

What to keep and why is decided by policy.decide (keep rules combined by "any keeps", and the
guards no rule can switch off); this module feeds it the facts (scan, archive proof, journal,
restore records) and acts on its decisions. `evaluate` returns the decisions and changes
nothing (`tiered-ckpt retention plan`); `apply` acts on them (`retention apply`).

Apply. Under an flock on <root>/<model>/.retention.lock it re-scans and re-proves (the
decisions a user looked at may be stale), then per checkpoint takes that checkpoint's own lock
without waiting (lock.checkpoint_lock: a save or restore holding it makes it "busy" this run)
and, holding it, re-checks the evidence: the same marker bytes as the evaluation saw and a
fresh archive proof (delete, release), or the journal entry still there and still no marker
(resume-delete). Only then: write a journal entry, record a tombstone (the name now lives only
in the archive), remove the marker (so it no longer looks committed anywhere on this tier),
remove the data, drop the journal entry. A run killed at any point leaves either a committed
checkpoint (untouched) or a journal entry that the next run finishes unless the name was saved
or restored since; never a directory that looks committed but is not. A checkpoint restored
less than `restore_grace` ago is kept, so that a restore is followed by its use.
"""
from __future__ import annotations

import logging
import os
import time
from collections.abc import Mapping, Sequence
from contextlib import ExitStack
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from tiered_ckpt import records
from tiered_ckpt.config import NodeConfig
from tiered_ckpt.errors import ConflictError, UserError
from tiered_ckpt.io import commit, fsafe
from tiered_ckpt.io.lock import checkpoint_lock, exclusive, lock_path
from tiered_ckpt.io.marker import MARKER, Manifest
from tiered_ckpt.lifecycle import pins, tombstone
from tiered_ckpt.lifecycle.journal import add as _journal_add
from tiered_ckpt.lifecycle.journal import forget, forget_restored, journaled, restored
from tiered_ckpt.lifecycle.policy import (
    BLOCKED,
    BUSY,
    DELETE,
    KEEP,
    RELEASE,
    RESUME,
    SKIP,
    Candidate,
    Decision,
    Policy,
    decide,
)
from tiered_ckpt.lifecycle.proof import CheckpointProof, prove
from tiered_ckpt.logs import fields
from tiered_ckpt.naming import parse_name
from tiered_ckpt.tiers.backends import TierBackend
from tiered_ckpt.tiers.blob import BlobInfo

log = logging.getLogger(__name__)

# --------------------------------------------------------------------------------------------
# I/O: gather candidates, evaluate, apply.

@dataclass
class RetentionDecisions:
    """The policy's decision for every checkpoint of a model at one moment (`retention plan`)."""

    model: str
    policy: Policy
    decisions: list[Decision]
    now_utc: str
    # Marker bytes of each committed checkpoint as the evaluation saw them: apply acts on a
    # checkpoint only if its marker is still exactly this (not part of the JSON).
    evidence: dict[str, bytes] = field(default_factory=dict, repr=False)

    def to_json(self) -> dict[str, Any]:
        return {
            "model": self.model,
            "policy": asdict(self.policy),
            "now_utc": self.now_utc,
            "checkpoints": [
                {"name": d.name, "decision": d.action, "reason": d.reason, "bytes": d.bytes} for d in self.decisions
            ],
        }


@dataclass
class ApplyResult:
    evaluated: RetentionDecisions                       # after apply: what was done instead, where it differed
    done: list[str] = field(default_factory=list)       # "delete <name>" / "release <name>"
    freed_bytes: int = 0

    @property
    def decisions(self) -> list[Decision]:
        return self.evaluated.decisions

    def to_json(self) -> dict[str, Any]:
        d = self.evaluated.to_json()
        d.update({"applied": self.done, "freed_bytes": self.freed_bytes})
        return d


def _created(m: Manifest | None) -> datetime | None:
    if m is None:
        return None
    try:
        t = datetime.fromisoformat(m.created_utc)
    except ValueError:
        return None
    return t if t.tzinfo else t.replace(tzinfo=timezone.utc)


def _dir_bytes(p: Path) -> int:
    total = 0
    for dirpath, _, names in os.walk(p):
        for n in names:
            try:
                total += os.lstat(os.path.join(dirpath, n)).st_size
            except OSError:
                pass
    return total


def candidates_from(infos: Sequence[commit.CheckpointInfo], proofs: dict[str, CheckpointProof], pending: set[str],
                    restored: Mapping[str, datetime] | None = None,
                    pinned: Mapping[str, Sequence[str]] | None = None) -> list[Candidate]:
    out = []
    for c in infos:
        p = proofs.get(c.name)
        out.append(Candidate(
            name=c.name, id=c.id, committed=c.committed, created_utc=_created(c.manifest),
            archived=bool(p and p.archived), blocked_by=p.blocked_reason() if p else "",
            released=bool(p and p.released),
            bytes=c.manifest.total_bytes if c.manifest else _dir_bytes(c.path),
            journaled=c.name in pending and not c.committed,
            restored_utc=(restored or {}).get(c.name),
            why_not=c.why_not_committed,
            pinned_by=tuple((pinned or {}).get(c.name, ())),
        ))
    return out


def _marker_bytes(root: str | os.PathLike[str], ckpt_dir: Path) -> bytes | None:
    """The marker's bytes as they are now (no symlink followed); None if absent or unreadable."""
    try:
        return commit.marker_bytes(ckpt_dir, anchor=root)
    except OSError:
        return None


def _evidence(root: str | os.PathLike[str], infos: Sequence[commit.CheckpointInfo]) -> dict[str, bytes]:
    """The marker bytes behind each committed checkpoint of a scan: what apply re-checks."""
    out: dict[str, bytes] = {}
    for c in infos:
        if c.manifest is None:
            continue
        data = _marker_bytes(root, c.path)
        try:
            same = data is not None and Manifest.from_json(data) == c.manifest
        except ValueError:
            same = False
        if same and data is not None:       # changed between the scan and this read: no evidence
            out[c.name] = data
    return out


def candidates(cfg: NodeConfig, backend: TierBackend) -> list[Candidate]:
    return _gather(cfg, backend)[0]


def _gather(cfg: NodeConfig, backend: TierBackend) -> tuple[list[Candidate], dict[str, bytes]]:
    infos = commit.scan(cfg.root, cfg.model, cfg.naming)
    evidence = _evidence(cfg.root, infos)
    cands = candidates_from(infos, prove(backend, infos), journaled(cfg.root, cfg.model),
                            restored(cfg.root, cfg.model), pins.pinned(cfg.root, cfg.model))
    return cands, evidence


def evaluate(cfg: NodeConfig, backend: TierBackend, policy: Policy, now: datetime | None = None) -> RetentionDecisions:
    """The policy's decisions for the model's checkpoints as they are now; changes nothing."""
    now = now or datetime.now(timezone.utc)
    commit.require_root(cfg.root)
    cands, evidence = _gather(cfg, backend)
    ev = RetentionDecisions(cfg.model, policy, decide(cands, policy, now), now.isoformat())
    ev.evidence = evidence
    return ev


def _reproved(cfg: NodeConfig, backend: TierBackend, infos: list[commit.CheckpointInfo]) -> dict[str, CheckpointProof]:
    """Fresh proofs for a few checkpoints: one listing of each one's own prefix, not of the model."""
    listing: dict[str, BlobInfo] | None = None
    if backend.archive_configured:
        listing = {}
        for c in infos:
            listing.update(backend.store.listing(f"{cfg.model}/{c.name}"))
    return prove(backend, infos, listing)


def _recheck(cfg: NodeConfig, backend: TierBackend, ev: RetentionDecisions,
             d: Decision) -> tuple[commit.CheckpointInfo | None, Decision | None]:
    """Under the checkpoint's lock: is the evidence for deleting/releasing `d` still true?

    (info, None) to go ahead, or (None, the decision to report instead).
    """
    path = commit.model_dir(cfg.root, cfg.model) / d.name
    cid = parse_name(d.name, cfg.naming)
    want = ev.evidence.get(d.name)
    if cid is None or want is None or not fsafe.is_real_dir(path) or _marker_bytes(cfg.root, path) != want:
        return None, Decision(d.name, SKIP, ("changed since the plan (re-saved, restored or removed): not touched; "
                                             "decided again next run",), d.bytes)
    info = commit.inspect(cfg.model, path, cid)
    if info.manifest is None:
        return None, Decision(d.name, SKIP, ("no longer committed: not touched",), d.bytes)
    proof = _reproved(cfg, backend, [info]).get(d.name)
    if proof is None or not proof.archived:
        why = proof.blocked_reason() if proof else "it is not proven archived"
        return None, Decision(d.name, BLOCKED, (f"no longer proven archived when it was to be {d.action}d: {why}",), d.bytes)
    return info, None


def _take_lock(stack: ExitStack, cfg: NodeConfig, d: Decision) -> Decision | None:
    """Take checkpoint d's lock into `stack`; None, or what to report instead: busy (held), or
    skipped when its lock file is not one (a planted symlink or FIFO: one checkpoint, not the run)."""
    try:
        stack.enter_context(checkpoint_lock(cfg.root, cfg.model, d.name, "retention", wait=0))
    except ConflictError:
        return _busy(d)
    except UserError as e:
        log.warning("retention skipped %s: %s", d.name, e,
                    extra=fields("retention", model=cfg.model, checkpoint=d.name, outcome="skipped"))
        return Decision(d.name, SKIP, (f"not touched: {e}",), d.bytes)
    return None


def _busy(d: Decision) -> Decision:
    return Decision(d.name, BUSY, (f"another process (a save or a restore) holds checkpoint {d.name}: not touched "
                                   "this run; decided again next run",), d.bytes)


def apply(cfg: NodeConfig, backend: TierBackend, policy: Policy, now: datetime | None = None) -> ApplyResult:
    """Evaluate and act under the lock. Safe to re-run after a kill at any point.

    Every delete and release takes that checkpoint's own lock (without waiting: a save or a
    restore holding it makes the checkpoint "busy" this run) and re-checks, holding it, the
    evidence the evaluation used: the same marker bytes and a fresh archive proof (delete/release),
    or the journal entry still there and still no marker (resume-delete).
    """
    commit.require_root(cfg.root)       # before the lock: exclusive() would create <root>/<model>
    mdir = commit.model_dir(cfg.root, cfg.model)
    if os.path.islink(mdir):
        raise UserError(f"model directory {mdir} is a symbolic link; retention never follows one (it would act "
                        "outside the checkpoint root): replace it with the real directory, or point root: at it")
    started = time.monotonic()
    try:
        res = _apply(cfg, backend, policy, now)
    except Exception as e:
        log.error("retention apply of %s failed: %s", cfg.model, e,
                  extra=fields("retention", model=cfg.model, duration_s=time.monotonic() - started, outcome="error"))
        raise
    _log_run(cfg, res, time.monotonic() - started)
    return res


def _log_run(cfg: NodeConfig, res: ApplyResult, seconds: float) -> None:
    """One record per checkpoint freed, one for the run (WARNING when some could not be freed)."""
    size = {d.name: d.bytes for d in res.decisions}
    for done in res.done:                    # "delete <name>" / "release <name>"
        verb, _, name = done.partition(" ")
        log.info("retention %sd %s (%d bytes)", verb, name, size.get(name, 0),
                 extra=fields(f"retention {verb}", model=cfg.model, checkpoint=name, nbytes=size.get(name)))
    blocked = [d.name for d in res.decisions if d.action == BLOCKED]
    log.log(logging.WARNING if blocked else logging.INFO,
            "retention of %s: %d freed (%d bytes)%s", cfg.model, len(res.done), res.freed_bytes,
            f"; {len(blocked)} blocked, not proven archived: {', '.join(blocked[:5])}" if blocked else "",
            extra=fields("retention", model=cfg.model, duration_s=seconds, nbytes=res.freed_bytes,
                         outcome="blocked" if blocked else "ok", freed=len(res.done), blocked=len(blocked)))


def _apply(cfg: NodeConfig, backend: TierBackend, policy: Policy, now: datetime | None) -> ApplyResult:
    # Anchored: the lock file is never created through a symlinked model directory.
    with exclusive(lock_path(cfg.root, cfg.model), "retention apply", anchor=cfg.root):
        ev = evaluate(cfg, backend, policy, now)
        res = ApplyResult(ev)
        root = cfg.root
        model_dir = commit.model_dir(root, cfg.model)
        # Leftover journal entries whose directory is gone, or committed again (a restore
        # brought it back): drop them, so they can never mark a later restore for deletion.
        for name in journaled(root, cfg.model):
            where = model_dir / name
            if parse_name(name, cfg.naming) is None or not where.exists() or commit.read_marker(where) is not None:
                forget(root, cfg.model, name)
        # Restore records past their grace period, or of checkpoints gone: no longer needed.
        cutoff = datetime.now(timezone.utc).timestamp() - policy.restore_grace
        for name, when in restored(root, cfg.model).items():
            if when.timestamp() < cutoff or not (model_dir / name).exists():
                forget_restored(root, cfg.model, name)
        outcome: dict[str, Decision] = {}
        releases: list[Decision] = []
        for d in ev.decisions:
            if d.action in (DELETE, RESUME):
                outcome[d.name] = _delete_one(cfg, backend, ev, d, res)
            elif d.action == RELEASE:
                releases.append(d)
        if releases:
            outcome.update(_release_all(cfg, backend, ev, releases, res))
        ev.decisions = [outcome.get(d.name, d) for d in ev.decisions]
        _record(cfg, res)
        return res


def _record(cfg: NodeConfig, res: ApplyResult) -> None:
    """This run's outcome and running totals, for `tiered-ckpt metrics`."""
    deleted = sum(1 for x in res.done if x.startswith("delete "))
    released = sum(1 for x in res.done if x.startswith("release "))
    blocked = sum(1 for d in res.decisions if d.action == BLOCKED)
    # Each checkpoint retention acted on or could not free, and why (the timeline shows them).
    acted = [{"name": d.name, "action": d.action, "reason": d.reason} for d in res.decisions if d.action != KEEP]
    records.record(cfg.root, cfg.model, records.RETENTION,
                   {"deleted": deleted, "released": released, "blocked": blocked, "freed_bytes": res.freed_bytes,
                    "decisions": acted},
                   totals={"deleted": deleted, "released": released, "runs": 1})


def _delete_one(cfg: NodeConfig, backend: TierBackend, ev: RetentionDecisions, d: Decision,
                res: ApplyResult) -> Decision:
    root = cfg.root
    path = commit.model_dir(root, cfg.model) / d.name
    with ExitStack() as stack:
        instead = _take_lock(stack, cfg, d)
        if instead is not None:
            return instead
        if d.action == RESUME:
            # Finish an interrupted delete only if nothing took the name since: the entry is
            # still there (a new save or a restore drops it, holding this lock) and there is
            # still no marker of any kind.
            if d.name not in journaled(root, cfg.model):
                return Decision(d.name, SKIP, ("its journal entry is gone (saved or restored since the plan): "
                                               "not touched",), d.bytes)
            if os.path.lexists(path / MARKER) or not fsafe.is_real_dir(path):
                return Decision(d.name, SKIP, ("it has a marker again (or is no longer a directory): not touched",),
                                d.bytes)
            entry = _journal_add(root, cfg.model, d.name)
            commit.remove_checkpoint(path, anchor=root)
        else:
            info, instead = _recheck(cfg, backend, ev, d)
            if instead is not None:
                return instead
            assert info is not None and info.manifest is not None
            entry = _journal_add(root, cfg.model, d.name)
            # Before the marker goes: the name now lives only in the archive.
            tombstone.record(root, cfg.model, d.name, info.manifest)
            commit.remove_checkpoint(path, anchor=root)          # marker first, then data
        fsafe.unlink(entry, anchor=root)
        forget_restored(root, cfg.model, d.name)
    res.done.append(f"delete {d.name}")
    res.freed_bytes += d.bytes
    return d


def _release_all(cfg: NodeConfig, backend: TierBackend, ev: RetentionDecisions, releases: list[Decision],
                 res: ApplyResult) -> dict[str, Decision]:
    """Release under every checkpoint's lock at once, so that one lfs call covers many checkpoints."""
    out: dict[str, Decision] = {}
    with ExitStack() as stack:
        ready: list[tuple[Decision, commit.CheckpointInfo]] = []
        for d in releases:
            instead = _take_lock(stack, cfg, d)
            if instead is not None:
                out[d.name] = instead
                continue
            info, instead = _recheck(cfg, backend, ev, d)
            if instead is not None:
                out[d.name] = instead
                continue
            assert info is not None
            ready.append((d, info))
        to_release = [str(info.path / f.path) for _, info in ready for f in info.manifest.files]  # type: ignore[union-attr]
        if to_release:
            # Only what is not released yet: a re-run after a kill must not trip over done work.
            hsm = backend.hsm_states(to_release)
            if hsm is not None:
                to_release = [p for p in to_release if p not in hsm[0] or not hsm[0][p].released]
            if to_release:
                backend.release(to_release)
        for d, _ in ready:
            res.done.append(f"release {d.name}")
            res.freed_bytes += d.bytes
    return out


__all__ = [
    # the pure policy, re-exported: callers that apply retention need its names too
    "BLOCKED", "BUSY", "DELETE", "KEEP", "RELEASE", "RESUME", "SKIP", "Candidate", "Decision", "Policy", "decide",
    # this module
    "ApplyResult", "RetentionDecisions", "apply", "candidates", "candidates_from", "evaluate",
]
