"""The keep rules as objects: each one answers with its reason or None; AnyKeep is their union."""
from __future__ import annotations

from datetime import datetime, timedelta, timezone

from tiered_ckpt.config import RetentionConfig
from tiered_ckpt.lifecycle.policy import (
    AnyKeep,
    Candidate,
    KeepEverySteps,
    KeepLast,
    KeepNewerThan,
    KeepPinned,
    KeepRestoredWithin,
    Policy,
    decide,
    guards,
)
from tiered_ckpt.naming import CheckpointId

NOW = datetime(2026, 1, 2, 12, 0, tzinfo=timezone.utc)


def cand(step: int, age_h: float | None = 100.0, restored_h: float | None = None) -> Candidate:
    return Candidate(f"global_epoch0_step{step}", CheckpointId(0, step), True,
                     created_utc=None if age_h is None else NOW - timedelta(hours=age_h),
                     restored_utc=None if restored_h is None else NOW - timedelta(hours=restored_h))


def test_each_rule_gives_its_reason_or_none() -> None:
    assert KeepLast(2).reason(cand(1), 1, NOW) == "keep-last 2"
    assert KeepLast(2).reason(cand(1), 2, NOW) is None
    assert KeepEverySteps(500).reason(cand(1000), 9, NOW) == "keep-every-steps 500"
    assert KeepEverySteps(500).reason(cand(1001), 9, NOW) is None
    assert KeepNewerThan(6 * 3600).reason(cand(1, age_h=1), 9, NOW) == "keep-newer-than 6.0h (age 1.0h)"
    assert KeepNewerThan(6 * 3600).reason(cand(1, age_h=7), 9, NOW) is None
    assert KeepNewerThan(6 * 3600).reason(cand(1, age_h=None), 9, NOW) is None      # no creation time known
    assert KeepRestoredWithin(3600).reason(cand(1, restored_h=0.25), 9, NOW) == "restored 15.0m ago (restore-grace 1.0h)"
    assert KeepRestoredWithin(3600).reason(cand(1, restored_h=2), 9, NOW) is None
    assert KeepRestoredWithin(3600).reason(cand(1), 9, NOW) is None


def test_any_keep_names_every_rule_that_keeps_in_order() -> None:
    keep = AnyKeep((KeepLast(3), KeepEverySteps(10), KeepNewerThan(3600)))
    assert keep.reasons(cand(20, age_h=0.5), 0, NOW) == ("keep-last 3", "keep-every-steps 10", "keep-newer-than 1.0h (age 30.0m)")
    assert keep.reasons(cand(21), 5, NOW) == ()


def test_guards_are_not_keep_rules() -> None:
    assert guards(0, 2) == ("newest committed", "among the newest 2 committed (min-keep)")
    assert guards(1, 2) == ("among the newest 2 committed (min-keep)",)
    assert guards(2, 2) == ()


def test_from_config_builds_only_the_rules_switched_on() -> None:
    rules = Policy.from_config(RetentionConfig(keep_last=4), restore_grace=0.0).keep_rules().rules
    assert rules == (KeepLast(4), KeepPinned())            # keep-pins are always honoured
    p = Policy(keep_last=2, keep_every_steps=100, keep_newer_than=60.0, restore_grace=30.0)
    assert p.keep_rules().rules == (KeepLast(2), KeepPinned(), KeepEverySteps(100), KeepNewerThan(60.0),
                                    KeepRestoredWithin(30.0))


def test_a_pinned_checkpoint_is_kept_whatever_the_other_rules_say() -> None:
    from dataclasses import replace

    old = replace(cand(5), archived=True, pinned_by=("lightning: /runs/ck/epoch=0-step=5.ckpt",))
    newer = [cand(s) for s in (10, 20, 30)]
    d = {x.name: x for x in decide([old, *newer], Policy(keep_last=1, min_keep=1, restore_grace=0), NOW)}
    assert d[old.name].action == "keep" and d[old.name].reasons == ("pinned (lightning: /runs/ck/epoch=0-step=5.ckpt)",)
