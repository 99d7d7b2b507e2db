"""Settings that would only fail on Azure or on a VM are refused at plan time: the retention timer's
OnCalendar schedule (systemd-analyze is the oracle) and checkpoint prefixes that would also match a sibling."""
from __future__ import annotations

import shutil
import subprocess

import pytest

from components.settings import oncalendar, schema
from tiered_ops.mockrun import stack_config

from .conftest import SSH_KEY, Plan

pytestmark = pytest.mark.timeout(60)

# Accepted and refused by systemd (checked against systemd-analyze below, where it is installed).
VALID = ["*:0/15", "hourly", "HOURLY", "daily", "weekly UTC", "Mon..Fri 02:00", "Sat,Sun *-*-* 00:00", "*-*-* *:*:*",
         "*:0,15,30,45", "*:2..5/2", "*-02~03", "*-*", "02:00 Europe/Berlin", "00:00:00 UTC", "*:*:05.5",
         "Fri *-*-1..7 3:00", "2026-02-30", "@1700000000", "Mon", "1..3:00"]
INVALID = ["*:0/0", "*:60", "*-*-* 24:00", "*:5..2", "Tue..Mon 1:00", "daily daily", "*:0 UTC UTC", "*/2:00", "+5:00",
           "0x10:00", " *:0/15", "*:0/15 ", "5", "1969-01-01", "2200-01-01", "02:00 Mars/Base", "every 15 minutes",
           "*-13-01", "*-*-32", "*:,5", "", "*:0/15; rm -rf /"]


@pytest.mark.parametrize("spec", VALID + INVALID)
def test_schedule_validator_agrees_with_systemd(spec: str) -> None:
    ours = oncalendar.problem(spec) is None
    assert ours == (spec in VALID), (spec, oncalendar.problem(spec))
    exe = shutil.which("systemd-analyze")
    if exe is None:
        pytest.skip("systemd-analyze is not installed: the oracle half of this test needs it")
    r = subprocess.run([exe, "calendar", spec], capture_output=True, text=True, timeout=30)
    assert (r.returncode == 0) == ours, (spec, r.stdout + r.stderr)


def _refused(stack: str, **over: str) -> str:
    with pytest.raises(schema.SettingsError) as err:
        schema.load(stack_config(stack, {"sshPublicKey": SSH_KEY, **over}), stack)
    return str(err.value)


def test_a_bad_schedule_is_refused_with_what_is_wrong_and_how_to_check() -> None:
    msg = _refused("dev", retentionSchedule="*:0/0")
    assert "tiered:retentionSchedule" in msg and "'*:0/0'" in msg and "systemd-analyze calendar" in msg
    assert "\n" not in msg
    schema.load(stack_config("dev", {"sshPublicKey": SSH_KEY, "retentionSchedule": "Mon..Fri 02:00"}), "dev")


@pytest.mark.parametrize(("prefix", "sibling"), [("/w", "work"), ("/work", "work"), ("/work/ckpt", "work"),
                                                 ("/.slurm", ".slurm"), ("/.t", ".tiered-ckpt")])
def test_a_checkpoint_prefix_that_also_matches_a_sibling_is_refused(prefix: str, sibling: str) -> None:
    msg = _refused("prod", checkpointPrefix=prefix)
    assert "tiered:checkpointPrefix" in msg and f"'{prefix}'" in msg and sibling in msg and "string prefix" in msg


@pytest.mark.parametrize("prefix", ["/checkpoints", "/ckpt/llama", "/runs"])
def test_prefixes_no_sibling_starts_with_pass(prefix: str) -> None:
    s = schema.load(stack_config("prod", {"sshPublicKey": SSH_KEY, "checkpointPrefix": prefix}), "prod")
    assert s.blob_prefix == prefix.strip("/")


@pytest.mark.parametrize("stack", ["dev", "prod"])
def test_an_age_based_archive_delete_is_refused_and_points_to_archive_retention(stack: str) -> None:
    msg = _refused(stack, deleteAfterDays="30")
    assert "tiered:deleteAfterDays" in msg and "30" in msg and "tiered-ckpt archive retention" in msg
    assert "newest" in msg and "\n" not in msg


@pytest.mark.parametrize("stack", ["dev", "prod"])
def test_the_lifecycle_policy_only_tiers_and_never_deletes(plan: Plan, stack: str) -> None:
    p = plan(stack)
    for rule in p.one("azure-native:storage:ManagementPolicy").inputs["policy"]["rules"]:
        actions = rule["definition"]["actions"]
        assert "delete" not in actions.get("baseBlob", {}) and "snapshot" not in actions and "version" not in actions
        assert set(actions["baseBlob"]) <= {"tierToCool", "tierToCold"}
