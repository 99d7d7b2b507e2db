"""Retention: a pure policy (what to keep and why) and an apply step (I/O, locked, idempotent).

Policy. Keep rules combine as a union, like Orbax's preservation policies: a checkpoint is
kept if any rule keeps it (keep the last N, keep every K steps, keep newer than an age).
Never touched, whatever the rules: anything not committed (in flight), the newest committed
and the newest `min_keep` committed (a crash while saving must never leave zero complete
checkpoints: RWKV-infctx-trainer #13). A checkpoint the rules let go is deleted or released
only when every file is proven archived; otherwise it is blocked, naming the first file.

Apply. Under an flock on <root>/<model>/.retention.lock it re-scans and re-proves (the plan a
user looked at may be stale), then per checkpoint: write a journal entry, remove the marker
(so it no longer looks committed anywhere on this tier), remove the data, drop the journal
entry. A run killed at any point leaves either a committed checkpoint (untouched) or a
journal entry that the next run finishes; never a directory that looks committed but is not.
"""
from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from . import manifest as mf
from .backends import TierBackend
from .config import NodeConfig, RetentionConfig
from .errors import ConfigError
from .journal import add as _journal_add
from .journal import forget, journaled
from .lock import exclusive, lock_path
from .naming import CheckpointId, parse_name
from .proof import CheckpointProof, prove

KEEP, DELETE, RELEASE, BLOCKED, SKIP, RESUME = "keep", "delete", "release", "blocked", "skip", "resume-delete"


@dataclass(frozen=True)
class Policy:
    keep_last: int = 3
    keep_every_steps: int = 0
    keep_newer_than: float | None = None   # seconds
    min_keep: int = 2
    action: str = "delete"

    @classmethod
    def from_config(cls, r: RetentionConfig, **overrides: Any) -> Policy:
        p = cls(r.keep_last, r.keep_every_steps, r.keep_newer_than, r.min_keep, r.action)
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


@dataclass(frozen=True)
class Decision:
    name: str
    action: str                   # keep | delete | release | blocked | skip | resume-delete
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
                out.append(Decision(c.name, SKIP, ("not committed (in flight or incomplete): never touched",), c.bytes))
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


def candidates_from(infos: Sequence[mf.CheckpointInfo], proofs: dict[str, CheckpointProof], pending: set[str]) -> list[Candidate]:
    out = []
    for c in infos:
        p = proofs.get(c.name)
        out.append(Candidate(
            name=c.name, id=c.id, committed=c.committed, created_utc=_created(c.manifest),
            archived=bool(p and p.archived), blocked_by=p.blocked_reason() if p else "",
            released=bool(p and p.released),
            bytes=c.manifest.total_bytes if c.manifest else _dir_bytes(c.path),
            journaled=c.name in pending and not c.committed,
        ))
    return out


def candidates(cfg: NodeConfig, backend: TierBackend) -> list[Candidate]:
    infos = mf.scan(cfg.root, cfg.model)
    return candidates_from(infos, prove(backend, infos), journaled(cfg.root, cfg.model))


def plan(cfg: NodeConfig, backend: TierBackend, policy: Policy, now: datetime | None = None) -> Plan:
    now = now or datetime.now(timezone.utc)
    mf.require_root(cfg.root)
    return Plan(cfg.model, policy, decide(candidates(cfg, backend), policy, now), now.isoformat())


def apply(cfg: NodeConfig, backend: TierBackend, policy: Policy, now: datetime | None = None) -> ApplyResult:
    """Plan and act under the lock. Safe to re-run after a kill at any point."""
    mf.require_root(cfg.root)       # before the lock: exclusive() would create <root>/<model>
    with exclusive(lock_path(cfg.root, cfg.model), "retention apply"):
        pl = plan(cfg, backend, policy, now)
        res = ApplyResult(pl)
        model_dir = mf.model_dir(cfg.root, cfg.model)
        # Leftover journal entries whose directory is gone, or committed again (a restore
        # brought it back): drop them, so they can never mark a later restore for deletion.
        for name in journaled(cfg.root, cfg.model):
            where = model_dir / name
            if parse_name(name) is None or not where.exists() or mf.read_marker(where) is not None:
                forget(cfg.root, cfg.model, name)
        to_release: list[str] = []
        for d in pl.decisions:
            path = model_dir / d.name
            if d.action in (DELETE, RESUME):
                entry = _journal_add(cfg.root, cfg.model, d.name)
                mf.remove_checkpoint(path)          # marker first, then data
                entry.unlink(missing_ok=True)
                res.done.append(f"delete {d.name}")
                res.freed_bytes += d.bytes
            elif d.action == RELEASE:
                m = mf.read_marker(path)
                if m is not None:
                    to_release.extend(str(path / f.path) for f in m.files)
                    res.done.append(f"release {d.name}")
                    res.freed_bytes += d.bytes
        if to_release:
            # Only what is not released yet: a re-run after a kill must not trip over done work.
            hsm = backend.hsm_states(to_release)
            if hsm is not None:
                to_release = [p for p in to_release if p not in hsm[0] or not hsm[0][p].released]
            if to_release:
                backend.release(to_release)
        return res
