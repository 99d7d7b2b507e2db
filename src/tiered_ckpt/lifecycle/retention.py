"""Retention: a pure policy (what to keep and why) and an apply step (I/O, locked, idempotent).

Policy. Keep rules combine as a union, like Orbax's preservation policies: a checkpoint is
kept if any rule keeps it (keep the last N, keep every K steps, keep newer than an age).
Never touched, whatever the rules: anything not committed (in flight), the newest committed
and the newest `min_keep` committed (a crash while saving must never leave zero complete
checkpoints: RWKV-infctx-trainer #13). A checkpoint the rules let go is deleted or released
only when every file is proven archived; otherwise it is blocked, naming the first file.

Apply. Under an flock on <root>/<model>/.retention.lock it re-scans and re-proves (the plan a
user looked at may be stale), then per checkpoint takes that checkpoint's own lock without
waiting (lock.checkpoint_lock: a save or restore holding it makes it "busy" this run) and,
holding it, re-checks the evidence: the same marker bytes as the plan saw and a fresh archive
proof (delete, release), or the journal entry still there and still no marker (resume-delete).
Only then: write a journal entry, record a tombstone (the name now lives only in the archive),
remove the marker (so it no longer looks committed anywhere on this tier), remove the data,
drop the journal entry. A run killed at any point leaves either a committed checkpoint
(untouched) or a journal entry that the next run finishes unless the name was saved or
restored since; never a directory that looks committed but is not. A checkpoint restored less
than `restore_grace` ago is kept, so that a restore is followed by its use.
"""
from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from contextlib import ExitStack
from dataclasses import asdict, dataclass, field, replace
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from tiered_ckpt.config import NodeConfig, RetentionConfig
from tiered_ckpt.errors import ConfigError, ConflictError
from tiered_ckpt.io import commit as mf
from tiered_ckpt.io import fsafe
from tiered_ckpt.io.lock import checkpoint_lock, exclusive, lock_path
from tiered_ckpt.lifecycle import tombstone
from tiered_ckpt.lifecycle.journal import add as _journal_add
from tiered_ckpt.lifecycle.journal import forget, forget_restored, journaled, restored
from tiered_ckpt.lifecycle.proof import CheckpointProof, prove
from tiered_ckpt.naming import CheckpointId, parse_name
from tiered_ckpt.tiers.backends import TierBackend
from tiered_ckpt.tiers.blob import BlobInfo

KEEP, DELETE, RELEASE, BLOCKED, SKIP, RESUME = "keep", "delete", "release", "blocked", "skip", "resume-delete"
BUSY = "busy"       # apply only: another process held the checkpoint's lock; decided again next run


@dataclass(frozen=True)
class Policy:
    keep_last: int = 3
    keep_every_steps: int = 0
    keep_newer_than: float | None = None   # seconds
    min_keep: int = 2
    action: str = "delete"
    restore_grace: float = 3600.0          # seconds a restored checkpoint is kept

    @classmethod
    def from_config(cls, r: RetentionConfig, **overrides: Any) -> Policy:
        p = cls(r.keep_last, r.keep_every_steps, r.keep_newer_than, r.min_keep, r.action,
                getattr(r, "restore_grace", 3600.0))
        p = replace(p, **{k: v for k, v in overrides.items() if v is not None})
        p.validate()
        return p

    def validate(self) -> None:
        if self.keep_last < 1:
            raise ConfigError(f"--keep-last / retention.keep_last: {self.keep_last} must be >= 1")
        if self.keep_every_steps < 0:
            raise ConfigError(f"--keep-every-steps / retention.keep_every_steps: {self.keep_every_steps} must be >= 0 (0 = off)")
        if self.min_keep < 1:
            raise ConfigError(f"--min-keep / retention.min_keep: {self.min_keep} must be >= 1")
        if self.keep_newer_than is not None and self.keep_newer_than < 0:
            raise ConfigError("--keep-newer-than / retention.keep_newer_than must not be negative")
        if self.action not in (DELETE, RELEASE):
            raise ConfigError(f"--action / retention.action: {self.action!r}; use delete or release")
        if self.restore_grace < 0:
            raise ConfigError("--restore-grace / retention.restore_grace must not be negative (0 = off)")


@dataclass(frozen=True)
class Candidate:
    """What the policy needs to know about one checkpoint directory."""

    name: str
    id: CheckpointId
    committed: bool
    created_utc: datetime | None = None
    archived: bool = False
    blocked_by: str = ""          # first file not archived, and why
    released: bool = False
    bytes: int = 0
    journaled: bool = False       # a killed apply was deleting it
    restored_utc: datetime | None = None   # when `restore` last brought it back (or checked it)
    why_not: str | None = None    # not committed because its marker is invalid / files do not match


@dataclass(frozen=True)
class Decision:
    name: str
    action: str                   # keep | delete | release | blocked | skip | resume-delete | busy
    reasons: tuple[str, ...]
    bytes: int = 0

    @property
    def reason(self) -> str:
        return "; ".join(self.reasons)


def decide(candidates: Sequence[Candidate], policy: Policy, now: datetime) -> list[Decision]:
    """The decision for every checkpoint, oldest first. Pure: no I/O, no clock."""
    done = sorted((c for c in candidates if c.committed), key=lambda c: c.id, reverse=True)
    rank = {c.name: i for i, c in enumerate(done)}
    out: list[Decision] = []
    for c in sorted(candidates, key=lambda c: c.id):
        if not c.committed:
            if c.journaled:
                out.append(Decision(c.name, RESUME, ("an earlier apply was deleting it (marker already removed); finishing",), c.bytes))
            else:
                why = f"{c.why_not}: never touched" if c.why_not else "not committed (in flight or incomplete): never touched"
                out.append(Decision(c.name, SKIP, (why,), c.bytes))
            continue
        i = rank[c.name]
        guards: list[str] = []
        if i == 0:
            guards.append("newest committed")
        if i < policy.min_keep:
            guards.append(f"among the newest {policy.min_keep} committed (min-keep)")
        keeps: list[str] = []
        if i < policy.keep_last:
            keeps.append(f"keep-last {policy.keep_last}")
        if policy.keep_every_steps and c.id.step % policy.keep_every_steps == 0:
            keeps.append(f"keep-every-steps {policy.keep_every_steps}")
        if policy.keep_newer_than is not None and c.created_utc is not None:
            age = (now - c.created_utc).total_seconds()
            if age < policy.keep_newer_than:
                keeps.append(f"keep-newer-than {_dur(policy.keep_newer_than)} (age {_dur(age)})")
        if policy.restore_grace and c.restored_utc is not None:
            since = (now - c.restored_utc).total_seconds()
            if since < policy.restore_grace:
                keeps.append(f"restored {_dur(since)} ago (restore-grace {_dur(policy.restore_grace)})")
        if guards or keeps:
            out.append(Decision(c.name, KEEP, tuple(guards + keeps), c.bytes))
        elif not c.archived:
            out.append(Decision(c.name, BLOCKED, (f"no keep rule applies, but {c.blocked_by or 'it is not proven archived'}",), c.bytes))
        elif policy.action == RELEASE and c.released:
            out.append(Decision(c.name, KEEP, ("already released (data in the archive, names kept)",), c.bytes))
        else:
            verb = "delete" if policy.action == DELETE else "release"
            out.append(Decision(c.name, policy.action, (f"no keep rule applies and every file is proven archived: {verb}",), c.bytes))
    return out


def _dur(seconds: float) -> str:
    s = max(0.0, seconds)
    for unit, n in (("d", 86400), ("h", 3600), ("m", 60)):
        if s >= n:
            return f"{s / n:.1f}{unit}"
    return f"{s:.0f}s"


# --------------------------------------------------------------------------------------------
# I/O: gather candidates, plan, apply.

@dataclass
class Plan:
    model: str
    policy: Policy
    decisions: list[Decision]
    now_utc: str
    # Marker bytes of each committed checkpoint as the plan saw them: apply acts on a
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
    plan: Plan
    done: list[str] = field(default_factory=list)       # "delete <name>" / "release <name>"
    freed_bytes: int = 0

    def to_json(self) -> dict[str, Any]:
        d = self.plan.to_json()
        d.update({"applied": self.done, "freed_bytes": self.freed_bytes})
        return d


def _created(m: mf.Manifest | None) -> datetime | None:
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


def candidates_from(infos: Sequence[mf.CheckpointInfo], proofs: dict[str, CheckpointProof], pending: set[str],
                    restored: Mapping[str, datetime] | None = None) -> list[Candidate]:
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
        ))
    return out


def _marker_bytes(root: str | os.PathLike[str], ckpt_dir: Path) -> bytes | None:
    """The marker's bytes as they are now (no symlink followed); None if absent or unreadable."""
    try:
        return fsafe.read_file(ckpt_dir / mf.MARKER, anchor=root, limit=64 << 20)
    except OSError:
        return None


def _evidence(root: str | os.PathLike[str], infos: Sequence[mf.CheckpointInfo]) -> dict[str, bytes]:
    """The marker bytes behind each committed checkpoint of a scan: what apply re-checks."""
    out: dict[str, bytes] = {}
    for c in infos:
        if c.manifest is None:
            continue
        data = _marker_bytes(root, c.path)
        try:
            same = data is not None and mf.Manifest.from_json(data) == c.manifest
        except ValueError:
            same = False
        if same and data is not None:       # changed between the scan and this read: no evidence
            out[c.name] = data
    return out


def candidates(cfg: NodeConfig, backend: TierBackend) -> list[Candidate]:
    return _gather(cfg, backend)[0]


def _gather(cfg: NodeConfig, backend: TierBackend) -> tuple[list[Candidate], dict[str, bytes]]:
    infos = mf.scan(cfg.root, cfg.model)
    evidence = _evidence(cfg.root, infos)
    cands = candidates_from(infos, prove(backend, infos), journaled(cfg.root, cfg.model),
                            restored(cfg.root, cfg.model))
    return cands, evidence


def plan(cfg: NodeConfig, backend: TierBackend, policy: Policy, now: datetime | None = None) -> Plan:
    now = now or datetime.now(timezone.utc)
    mf.require_root(cfg.root)
    cands, evidence = _gather(cfg, backend)
    pl = Plan(cfg.model, policy, decide(cands, policy, now), now.isoformat())
    pl.evidence = evidence
    return pl


def _reproved(cfg: NodeConfig, backend: TierBackend, infos: list[mf.CheckpointInfo]) -> dict[str, CheckpointProof]:
    """Fresh proofs for a few checkpoints: one listing of each one's own prefix, not of the model."""
    listing: dict[str, BlobInfo] | None = None
    if backend.archive_configured:
        listing = {}
        for c in infos:
            listing.update(backend.store.listing(f"{cfg.model}/{c.name}"))
    return prove(backend, infos, listing)


def _recheck(cfg: NodeConfig, backend: TierBackend, pl: Plan, d: Decision) -> tuple[mf.CheckpointInfo | None, Decision | None]:
    """Under the checkpoint's lock: is the plan's evidence for deleting/releasing `d` still true?

    (info, None) to go ahead, or (None, the decision to report instead).
    """
    path = mf.model_dir(cfg.root, cfg.model) / d.name
    cid = parse_name(d.name)
    want = pl.evidence.get(d.name)
    if cid is None or want is None or not fsafe.is_real_dir(path) or _marker_bytes(cfg.root, path) != want:
        return None, Decision(d.name, SKIP, ("changed since the plan (re-saved, restored or removed): not touched; "
                                             "decided again next run",), d.bytes)
    info = mf.inspect(cfg.model, path, cid)
    if info.manifest is None:
        return None, Decision(d.name, SKIP, ("no longer committed: not touched",), d.bytes)
    proof = _reproved(cfg, backend, [info]).get(d.name)
    if proof is None or not proof.archived:
        why = proof.blocked_reason() if proof else "it is not proven archived"
        return None, Decision(d.name, BLOCKED, (f"no longer proven archived when it was to be {d.action}d: {why}",), d.bytes)
    return info, None


def _busy(d: Decision) -> Decision:
    return Decision(d.name, BUSY, (f"another process (a save or a restore) holds checkpoint {d.name}: not touched "
                                   "this run; decided again next run",), d.bytes)


def apply(cfg: NodeConfig, backend: TierBackend, policy: Policy, now: datetime | None = None) -> ApplyResult:
    """Plan and act under the lock. Safe to re-run after a kill at any point.

    Every delete and release takes that checkpoint's own lock (without waiting: a save or a
    restore holding it makes the checkpoint "busy" this run) and re-checks, holding it, the
    evidence the plan used: the same marker bytes and a fresh archive proof (delete/release),
    or the journal entry still there and still no marker (resume-delete).
    """
    mf.require_root(cfg.root)       # before the lock: exclusive() would create <root>/<model>
    with exclusive(lock_path(cfg.root, cfg.model), "retention apply"):
        pl = plan(cfg, backend, policy, now)
        res = ApplyResult(pl)
        root = cfg.root
        model_dir = mf.model_dir(root, cfg.model)
        # Leftover journal entries whose directory is gone, or committed again (a restore
        # brought it back): drop them, so they can never mark a later restore for deletion.
        for name in journaled(root, cfg.model):
            where = model_dir / name
            if parse_name(name) is None or not where.exists() or mf.read_marker(where) is not None:
                forget(root, cfg.model, name)
        # Restore records past their grace period, or of checkpoints gone: no longer needed.
        cutoff = datetime.now(timezone.utc).timestamp() - policy.restore_grace
        for name, when in restored(root, cfg.model).items():
            if when.timestamp() < cutoff or not (model_dir / name).exists():
                forget_restored(root, cfg.model, name)
        outcome: dict[str, Decision] = {}
        releases: list[Decision] = []
        for d in pl.decisions:
            if d.action in (DELETE, RESUME):
                outcome[d.name] = _delete_one(cfg, backend, pl, d, res)
            elif d.action == RELEASE:
                releases.append(d)
        if releases:
            outcome.update(_release_all(cfg, backend, pl, releases, res))
        pl.decisions = [outcome.get(d.name, d) for d in pl.decisions]
        return res


def _delete_one(cfg: NodeConfig, backend: TierBackend, pl: Plan, d: Decision, res: ApplyResult) -> Decision:
    root = cfg.root
    path = mf.model_dir(root, cfg.model) / d.name
    try:
        with checkpoint_lock(root, cfg.model, d.name, "retention", wait=0):
            if d.action == RESUME:
                # Finish an interrupted delete only if nothing took the name since: the entry is
                # still there (a new save or a restore drops it, holding this lock) and there is
                # still no marker of any kind.
                if d.name not in journaled(root, cfg.model):
                    return Decision(d.name, SKIP, ("its journal entry is gone (saved or restored since the plan): "
                                                   "not touched",), d.bytes)
                if os.path.lexists(path / mf.MARKER) or not fsafe.is_real_dir(path):
                    return Decision(d.name, SKIP, ("it has a marker again (or is no longer a directory): not touched",),
                                    d.bytes)
                entry = _journal_add(root, cfg.model, d.name)
                mf.remove_checkpoint(path, anchor=root)
            else:
                info, instead = _recheck(cfg, backend, pl, d)
                if instead is not None:
                    return instead
                assert info is not None and info.manifest is not None
                entry = _journal_add(root, cfg.model, d.name)
                # Before the marker goes: the name now lives only in the archive.
                tombstone.record(root, cfg.model, d.name, info.manifest)
                mf.remove_checkpoint(path, anchor=root)          # marker first, then data
            fsafe.unlink(entry, anchor=root)
            forget_restored(root, cfg.model, d.name)
    except ConflictError:
        return _busy(d)
    res.done.append(f"delete {d.name}")
    res.freed_bytes += d.bytes
    return d


def _release_all(cfg: NodeConfig, backend: TierBackend, pl: Plan, releases: list[Decision],
                 res: ApplyResult) -> dict[str, Decision]:
    """Release under every checkpoint's lock at once, so that one lfs call covers many checkpoints."""
    out: dict[str, Decision] = {}
    with ExitStack() as stack:
        ready: list[tuple[Decision, mf.CheckpointInfo]] = []
        for d in releases:
            try:
                stack.enter_context(checkpoint_lock(cfg.root, cfg.model, d.name, "retention", wait=0))
            except ConflictError:
                out[d.name] = _busy(d)
                continue
            info, instead = _recheck(cfg, backend, pl, d)
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
