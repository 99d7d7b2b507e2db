"""The retention policy, pure: keep rules, guards, and the decision for every checkpoint.

No I/O and no clock: `decide(candidates, policy, now)` is a function of its arguments, so
every decision and its reason can be tested without a file system. retention.py gathers the
candidates (scan, archive proof, journal) and applies the decisions under locks.

Keep rules are small objects, one per rule, each answering "do you keep this checkpoint, and
why?" with a reason or None. `AnyKeep` combines them as a union: a checkpoint is kept if any
rule keeps it, and every rule that keeps it is named. This is the shape of Orbax's
preservation policies (`PreservationPolicy`, combined by `AnyPreservationPolicy`):
https://orbax.readthedocs.io/en/stable/api_reference/checkpoint.preservation_policy.html

Guards are not keep rules and no rule set can switch them off: a checkpoint that is not
committed (in flight, or its marker invalid) is never touched, nor the newest committed, nor
the newest `min_keep` committed (a crash while saving must never leave zero complete
checkpoints: RWKV-infctx-trainer #13), nor one not proven archived (it is "blocked", naming
the first file and why).
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from datetime import datetime
from typing import Any, Protocol

from tiered_ckpt.config import RetentionConfig, section_problems
from tiered_ckpt.errors import ConfigError
from tiered_ckpt.naming import CheckpointId

KEEP, DELETE, RELEASE, BLOCKED, SKIP, RESUME = "keep", "delete", "release", "blocked", "skip", "resume-delete"
BUSY = "busy"       # apply only: another process held the checkpoint's lock; decided again next run


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
    pinned_by: tuple[str, ...] = ()   # live keep-pins (pins.py): e.g. Lightning's best-k pointers


@dataclass(frozen=True)
class Decision:
    name: str
    action: str                   # keep | delete | release | blocked | skip | resume-delete | busy
    reasons: tuple[str, ...]
    bytes: int = 0

    @property
    def reason(self) -> str:
        return "; ".join(self.reasons)


# --------------------------------------------------------------------------------------------
# Keep rules: each one returns why it keeps a committed checkpoint, or None.

class KeepRule(Protocol):
    def reason(self, c: Candidate, rank: int, now: datetime) -> str | None:
        """Why this rule keeps `c`, or None. `rank`: 0 for the newest committed, 1 the next, ..."""
        ...


@dataclass(frozen=True)
class KeepLast:
    """Keep the newest `n` committed checkpoints."""

    n: int

    def reason(self, c: Candidate, rank: int, now: datetime) -> str | None:
        return f"keep-last {self.n}" if rank < self.n else None


@dataclass(frozen=True)
class KeepEverySteps:
    """Keep every checkpoint whose step is a multiple of `k` (k > 0)."""

    k: int

    def reason(self, c: Candidate, rank: int, now: datetime) -> str | None:
        return f"keep-every-steps {self.k}" if c.id.step % self.k == 0 else None


@dataclass(frozen=True)
class KeepNewerThan:
    """Keep checkpoints created less than `seconds` ago (by the marker's created_utc)."""

    seconds: float

    def reason(self, c: Candidate, rank: int, now: datetime) -> str | None:
        if c.created_utc is None:
            return None
        age = (now - c.created_utc).total_seconds()
        return f"keep-newer-than {_dur(self.seconds)} (age {_dur(age)})" if age < self.seconds else None


@dataclass(frozen=True)
class KeepRestoredWithin:
    """Keep a checkpoint restored less than `grace` seconds ago, so that a restore is followed by its use."""

    grace: float

    def reason(self, c: Candidate, rank: int, now: datetime) -> str | None:
        if c.restored_utc is None:
            return None
        since = (now - c.restored_utc).total_seconds()
        return f"restored {_dur(since)} ago (restore-grace {_dur(self.grace)})" if since < self.grace else None


@dataclass(frozen=True)
class KeepPinned:
    """Keep a checkpoint a framework pinned (pins.py): the ones Lightning's ModelCheckpoint keeps as
    best-k or last, so that `ckpt_path="best"` and a pointer never name a freed checkpoint. Always on."""

    def reason(self, c: Candidate, rank: int, now: datetime) -> str | None:
        return f"pinned ({', '.join(c.pinned_by)})" if c.pinned_by else None


@dataclass(frozen=True)
class AnyKeep:
    """The union of keep rules: kept if any rule keeps it; every rule that does is named, in order."""

    rules: tuple[KeepRule, ...]

    def reasons(self, c: Candidate, rank: int, now: datetime) -> tuple[str, ...]:
        return tuple(r for rule in self.rules if (r := rule.reason(c, rank, now)) is not None)


def guards(rank: int, min_keep: int) -> tuple[str, ...]:
    """Why a committed checkpoint of this rank may not go, whatever the keep rules say."""
    out: list[str] = []
    if rank == 0:
        out.append("newest committed")
    if rank < min_keep:
        out.append(f"among the newest {min_keep} committed (min-keep)")
    return tuple(out)


# --------------------------------------------------------------------------------------------
# The policy: the settings (what `retention plan --json` shows) and the rule set built from them.

# The defaults and the rules are the node config's (config.RetentionConfig), declared there once.
_DEFAULT = RetentionConfig()


@dataclass(frozen=True)
class Policy:
    keep_last: int = _DEFAULT.keep_last
    keep_every_steps: int = _DEFAULT.keep_every_steps
    keep_newer_than: float | None = _DEFAULT.keep_newer_than   # seconds
    min_keep: int = _DEFAULT.min_keep
    action: str = _DEFAULT.action
    restore_grace: float = _DEFAULT.restore_grace               # seconds a restored checkpoint is kept

    @classmethod
    def from_config(cls, r: RetentionConfig, **overrides: Any) -> Policy:
        """The node config's retention block, with command-line overrides (None = not given), validated."""
        p = cls(r.keep_last, r.keep_every_steps, r.keep_newer_than, r.min_keep, r.action, r.restore_grace)
        p = replace(p, **{k: v for k, v in overrides.items() if v is not None})
        p.validate()
        return p

    def keep_rules(self) -> AnyKeep:
        """The keep rules these settings switch on (a rule set to 0 / unset is off)."""
        rules: list[KeepRule] = [KeepLast(self.keep_last), KeepPinned()]
        if self.keep_every_steps:
            rules.append(KeepEverySteps(self.keep_every_steps))
        if self.keep_newer_than is not None:
            rules.append(KeepNewerThan(self.keep_newer_than))
        if self.restore_grace:
            rules.append(KeepRestoredWithin(self.restore_grace))
        return AnyKeep(tuple(rules))

    def validate(self) -> None:
        """The node config's retention rules; each problem names its flag and its setting."""
        problems = [f"--{key.removeprefix('retention.').replace('_', '-')} / {key}: {why}"
                    for key, why in section_problems("retention", asdict(self))]
        if len(problems) == 1:
            raise ConfigError(problems[0])
        if problems:
            raise ConfigError(f"{len(problems)} problems in the retention settings:\n  - " + "\n  - ".join(problems))


def decide(candidates: Sequence[Candidate], policy: Policy, now: datetime) -> list[Decision]:
    """The decision for every checkpoint, oldest first. Pure: no I/O, no clock."""
    done = sorted((c for c in candidates if c.committed), key=lambda c: c.id, reverse=True)
    rank = {c.name: i for i, c in enumerate(done)}
    keep = policy.keep_rules()
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
        held = guards(i, policy.min_keep) + keep.reasons(c, i, now)
        if held:
            out.append(Decision(c.name, KEEP, held, c.bytes))
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
