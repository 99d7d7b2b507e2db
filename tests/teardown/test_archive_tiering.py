"""Teardown says, for each checkpoint it leaves in the archive, when the Blob lifecycle policy tiers it and that
nothing expires by age (the policy only tiers; archive retention keeps the newest checkpoints)."""
from __future__ import annotations

import json
from datetime import datetime, timedelta, timezone

from .conftest import STACK, Env, archived_ckpts


def _set_config(env: Env, **cfg: str) -> None:
    path = env.state / "stacks.json"
    stacks = json.loads(path.read_text())
    stacks[STACK]["config"].update({f"tiered:{k}": v for k, v in cfg.items()})
    path.write_text(json.dumps(stacks))


def test_teardown_prints_when_each_kept_checkpoint_tiers_and_that_none_expires(env: Env) -> None:
    names = archived_ckpts(env)
    _set_config(env, coolAfterDays="7", coldAfterDays="60")
    r = env.run("--yes", "--json")
    assert r.rc == 0, r.err
    plan = {t["checkpoint"]: t for t in r.json()["archive_tiering"]}
    assert sorted(plan) == sorted(names)
    for t in plan.values():
        committed = datetime.fromisoformat(t["committed_utc"])
        assert datetime.fromisoformat(t["cool_from"]) == committed + timedelta(days=7)
        assert datetime.fromisoformat(t["cold_from"]) == committed + timedelta(days=60)
        assert t["expires"] is None


def test_the_text_report_names_each_checkpoint_with_its_dates_and_the_stack_defaults(env: Env) -> None:
    names = archived_ckpts(env, 1)
    _set_config(env, coldAfterDays="0")          # coolAfterDays unset: the program's default (30)
    dry = env.run("--dry-run")
    assert dry.rc == 0, dry.err
    r = env.run("--yes")
    assert r.rc == 0, r.err
    for out in (dry.err, r.out):
        line = next(ln for ln in out.splitlines() if ln.strip().startswith(names[0] + ":"))
        # Just committed, so the cool date is about 30 days from now (the day may roll over during the test).
        days = {(datetime.now(timezone.utc) + timedelta(days=30 + d)).date().isoformat() for d in (-1, 0)}
        assert any(f"cool on or after {day}" in line for day in days), line
        assert "no cold tier" in line and "never expires" in line
        assert "coolAfterDays 30, coldAfterDays 0" in out
