"""When each kept checkpoint's blobs move to cool/cold under the stack's Blob lifecycle policy (pure).

The policy's rules run on "days after modification" (Azure docs, "Optimize costs by automatically
managing the data lifecycle": daysAfterModificationGreaterThan, evaluated about once a day). A blob
is written when AMLFS exports it, after the checkpoint's commit, so commit + N days is the earliest a
checkpoint's blobs can move; they move within about a day after their own export + N days. The policy
deletes nothing (settings refuse deleteAfterDays): expiry is `tiered-ckpt archive retention`, which
never deletes the newest retentionMinKeep committed checkpoints.
"""
from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from components.settings.schema import NAMESPACE, SCHEMA_BY_NAME

LIFECYCLE_KEYS = ("coolAfterDays", "coldAfterDays")
NEVER_EXPIRES = ("never expires: the lifecycle policy only tiers; archive retention "
                 "(`tiered-ckpt archive retention plan`) decides deletes and keeps the newest checkpoints")


@dataclass(frozen=True)
class Tiering:
    checkpoint: str
    committed_utc: datetime | None
    cool_from: datetime | None       # None: that tier is off (0 days) or the commit time is unknown
    cold_from: datetime | None

    def sentence(self, cool_days: int, cold_days: int) -> str:
        def when(t: datetime | None, days: int, tier: str) -> str:
            if not days:
                return f"no {tier} tier"
            if t is None:
                return f"{tier} {days} days after export (commit time unknown)"
            return f"{tier} on or after {t.date().isoformat()}"
        return f"{self.checkpoint}: {when(self.cool_from, cool_days, 'cool')}, {when(self.cold_from, cold_days, 'cold')}; {NEVER_EXPIRES}"

    def to_json(self) -> dict[str, Any]:
        def iso(t: datetime | None) -> str | None:
            return t.isoformat(timespec="seconds") if t else None
        return {"checkpoint": self.checkpoint, "committed_utc": iso(self.committed_utc), "cool_from": iso(self.cool_from),
                "cold_from": iso(self.cold_from), "expires": None}


def lifecycle_days(config_get: Any) -> dict[str, int]:
    """The stack's coolAfterDays/coldAfterDays (config_get(key) -> str | None; unset = the program's default)."""
    out: dict[str, int] = {}
    for k in LIFECYCLE_KEYS:
        raw = config_get(f"{NAMESPACE}:{k}")
        out[k] = int(raw) if raw not in (None, "") else int(SCHEMA_BY_NAME[k].default)
    return out


def schedule(committed: dict[str, datetime | None], cool_days: int, cold_days: int) -> list[Tiering]:
    def plus(t: datetime | None, days: int) -> datetime | None:
        return t + timedelta(days=days) if (t is not None and days) else None
    return [Tiering(k, t, plus(t, cool_days), plus(t, cold_days)) for k, t in sorted(committed.items())]
