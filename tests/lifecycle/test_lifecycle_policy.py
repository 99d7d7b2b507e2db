"""The pure retention policy: union of keep rules, guards, blocked with the first file."""
from __future__ import annotations

import random
from datetime import datetime, timedelta, timezone

import pytest

from tiered_ckpt.config import RetentionConfig
from tiered_ckpt.errors import ConfigError
from tiered_ckpt.lifecycle.policy import BLOCKED, DELETE, KEEP, RELEASE, RESUME, SKIP, Candidate, Policy, decide
from tiered_ckpt.naming import CheckpointId

NOW = datetime(2026, 1, 2, 12, 0, tzinfo=timezone.utc)


def cand(step: int, *, committed: bool = True, archived: bool = True, age_h: float = 100.0, **kw: object) -> Candidate:
    return Candidate(name=f"global_epoch0_step{step}", id=CheckpointId(0, step), committed=committed,
                     created_utc=NOW - timedelta(hours=age_h), archived=archived, **kw)  # type: ignore[arg-type]


def by_name(decisions: list) -> dict[str, object]:
    return {d.name.split("_step")[1]: d for d in decisions}


def test_keep_rules_combine_as_a_union() -> None:
    cs = [cand(s, age_h=100 - s / 100) for s in (1000, 2000, 3000, 4000, 5000, 6000)]
    cs[1] = cand(2000, age_h=1)     # young
    p = Policy(keep_last=2, keep_every_steps=3000, keep_newer_than=6 * 3600, min_keep=1)
    d = by_name(decide(cs, p, NOW))
    assert d["6000"].action == KEEP and "newest committed" in d["6000"].reason
    assert d["5000"].action == KEEP and "keep-last 2" in d["5000"].reason
    assert d["3000"].action == KEEP and "keep-every-steps 3000" in d["3000"].reason
    assert d["2000"].action == KEEP and "keep-newer-than" in d["2000"].reason
    assert d["1000"].action == DELETE and d["4000"].action == DELETE


def test_min_keep_and_newest_guard_even_when_rules_let_go() -> None:
    cs = [cand(s) for s in (1, 2, 3)]
    d = by_name(decide(cs, Policy(keep_last=1, min_keep=2), NOW))
    assert d["3"].action == KEEP and d["2"].action == KEEP and "min-keep" in d["2"].reason
    assert d["1"].action == DELETE


def test_newest_committed_is_kept_even_if_not_archived_and_in_flight_is_never_touched() -> None:
    cs = [cand(1), cand(2, archived=False), cand(3, committed=False)]
    d = by_name(decide(cs, Policy(keep_last=1, min_keep=1), NOW))
    assert d["3"].action == SKIP and "in flight" in d["3"].reason
    assert d["2"].action == KEEP and "newest committed" in d["2"].reason
    assert d["1"].action == DELETE


def test_blocked_names_the_first_file_not_archived() -> None:
    cs = [cand(1, archived=False, blocked_by="m/global_epoch0_step1/rank0.bin is not archived: dirty"), cand(2), cand(3)]
    d = by_name(decide(cs, Policy(keep_last=1, min_keep=1), NOW))
    assert d["1"].action == BLOCKED and "rank0.bin" in d["1"].reason
    assert d["2"].action == DELETE


def test_release_action_and_already_released() -> None:
    cs = [cand(1, released=True), cand(2), cand(3)]
    d = by_name(decide(cs, Policy(keep_last=1, min_keep=1, action=RELEASE), NOW))
    assert d["1"].action == KEEP and "already released" in d["1"].reason
    assert d["2"].action == RELEASE


def test_interrupted_delete_is_resumed_not_skipped() -> None:
    cs = [cand(1, committed=False, journaled=True), cand(2, committed=False), cand(3)]
    d = by_name(decide(cs, Policy(), NOW))
    assert d["1"].action == RESUME and d["2"].action == SKIP


def test_invariants_on_random_histories() -> None:
    rng = random.Random(7)
    for _ in range(300):
        steps = sorted(rng.sample(range(1, 200), rng.randint(1, 12)))
        cs = [cand(s, committed=rng.random() > 0.2, archived=rng.random() > 0.3, age_h=rng.random() * 48) for s in steps]
        p = Policy(keep_last=rng.randint(1, 4), keep_every_steps=rng.choice([0, 10, 25]),
                   keep_newer_than=rng.choice([None, 3600.0, 86400.0]), min_keep=rng.randint(1, 3))
        ds = {d.name: d for d in decide(cs, p, NOW)}
        assert set(ds) == {c.name for c in cs}
        done = sorted((c for c in cs if c.committed), key=lambda c: c.id, reverse=True)
        protected = {c.name for c in done[: max(1, p.min_keep)]}
        for c in cs:
            act = ds[c.name].action
            if act in (DELETE, RELEASE):
                assert c.committed and c.archived and c.name not in protected
            if not c.committed:
                assert act == SKIP


def test_policy_from_config_with_overrides_and_validation() -> None:
    p = Policy.from_config(RetentionConfig(keep_last=5), keep_last=2, min_keep=None)
    assert p.keep_last == 2 and p.min_keep == 2
    with pytest.raises(ConfigError, match="--min-keep"):
        Policy.from_config(RetentionConfig(), min_keep=0)


def test_flags_are_checked_by_the_node_configs_own_rules_all_at_once() -> None:
    # the retention rules are RetentionConfig's: a flag breaks the same rule a config file would,
    # every broken one is named in one error, each with its flag and its setting
    with pytest.raises(ConfigError) as e:
        Policy.from_config(RetentionConfig(), keep_last=0, action="purge", restore_grace=-1.0)
    msg = str(e.value)
    assert msg.startswith("3 problems")
    for part in ("--keep-last / retention.keep_last: 0", "--action / retention.action: 'purge'",
                 "--restore-grace / retention.restore_grace: -1.0"):
        assert part in msg, msg
    with pytest.raises(ConfigError, match="--keep-last .* not a whole number"):
        Policy(keep_last=True).validate()      # type: ignore[arg-type]  (a bool is no count)
    assert Policy() == Policy.from_config(RetentionConfig())    # one set of defaults
