"""Settings: every bad config is refused before any resource, with one message naming key, value and fix."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from components.settings import azure, schema
from tiered_ops import mockrun
from tiered_ops.mockrun import stack_config

from .conftest import SSH_KEY, Plan

ROOT = Path(__file__).resolve().parents[2]

# (case, stack, overrides, expected message fragments: the key, the value, the fix)
BAD = [
    ("unknown sku", "prod", {"sku": "AMLFS-Durable-Premium-1000"}, ["tiered:sku", "'AMLFS-Durable-Premium-1000'", "use one of AMLFS-Durable-Premium-40"]),
    ("capacity below sku minimum", "prod", {"sku": "AMLFS-Durable-Premium-250", "capacityTiB": "4"}, ["tiered:capacityTiB", "4", "minimum", "use 8 or more"]),
    ("capacity below 40 sku minimum", "prod", {"sku": "AMLFS-Durable-Premium-40", "capacityTiB": "24"}, ["tiered:capacityTiB", "24", "use 48 or more"]),
    ("capacity off step", "prod", {"capacityTiB": "130"}, ["tiered:capacityTiB", "130", "step (4 TiB)", "128 or 132"]),
    ("capacity off step 125", "prod", {"sku": "AMLFS-Durable-Premium-125", "capacityTiB": "40"}, ["tiered:capacityTiB", "40", "32 or 48"]),
    ("above default max", "prod", {"capacityTiB": "132"}, ["tiered:capacityTiB", "132", "default maximum (128 TiB", "tiered:allowAboveDefaultMax true"]),
    ("amlfs subnet too small", "prod", {"amlfsSubnetCidr": "10.42.0.0/25"}, ["tiered:amlfsSubnetCidr", "10.42.0.0/25", "128 TiB", "/24"]),
    ("amlfs subnet too small dev", "dev", {"capacityTiB": "20", "amlfsSubnetCidr": "10.43.0.0/27"}, ["tiered:amlfsSubnetCidr", "/26"]),
    ("overlapping cidrs", "prod", {"computeSubnetCidr": "10.42.0.0/22", "access": "none"}, ["tiered:computeSubnetCidr", "10.42.0.0/22", "overlaps tiered:amlfsSubnetCidr", "disjoint"]),
    ("subnet outside vnet", "prod", {"amlfsSubnetCidr": "10.99.0.0/24"}, ["tiered:amlfsSubnetCidr", "10.99.0.0/24", "not inside tiered:vnetCidr"]),
    ("cidr with host bits", "prod", {"vnetCidr": "10.42.0.1/16"}, ["tiered:vnetCidr", "10.42.0.1/16", "host bits zero"]),
    ("non-ND vm size", "prod", {"vmSize": "Standard_D4s_v5"}, ["tiered:vmSize", "Standard_D4s_v5", "ND-series", "Standard_ND96isr_H100_v5"]),
    ("node count zero", "prod", {"nodeCount": "0"}, ["tiered:nodeCount", "0", "at least one node"]),
    ("node count not a number", "prod", {"nodeCount": "eight"}, ["tiered:nodeCount", "'eight'", "whole number"]),
    ("name prefix pattern", "prod", {"namePrefix": "Bad_Prefix"}, ["tiered:namePrefix", "'Bad_Prefix'", "lowercase letters and digits"]),
    ("maintenance day", "prod", {"maintenanceDay": "Funday"}, ["tiered:maintenanceDay", "'Funday'", "Monday", "Sunday"]),
    ("maintenance time", "prod", {"maintenanceTimeUtc": "25:00"}, ["tiered:maintenanceTimeUtc", "'25:00'", "HH:MM"]),
    ("maintenance time format", "prod", {"maintenanceTimeUtc": "2am"}, ["tiered:maintenanceTimeUtc", "'2am'", "HH:MM"]),
    ("retention keep-last zero", "prod", {"retentionKeepLast": "0"}, ["tiered:retentionKeepLast", "0", ">= 1"]),
    ("checkpoint prefix relative", "prod", {"checkpointPrefix": "checkpoints"}, ["tiered:checkpointPrefix", "'checkpoints'", "absolute", "/checkpoints"]),
    ("retention action", "prod", {"retentionAction": "purge"}, ["tiered:retentionAction", "'purge'", "delete or release"]),
    ("root squash", "prod", {"rootSquash": "Everyone"}, ["tiered:rootSquash", "'Everyone'", "RootOnly"]),
    ("ssh from the internet", "prod", {"sshSourcePrefix": "0.0.0.0/0"}, ["tiered:sshSourcePrefix", "0.0.0.0/0", "whole internet"]),
    ("ssh key missing", "prod", {"sshPublicKey": ""}, ["tiered:sshPublicKey", "''", "pulumi config set tiered:sshPublicKey"]),
    ("ssh private key", "prod", {"sshPublicKey": "-----BEGIN OPENSSH PRIVATE KEY-----"}, ["tiered:sshPublicKey", "private key", "PUBLIC key"]),
    ("role wait", "prod", {"roleWaitDuration": "five minutes"}, ["tiered:roleWaitDuration", "'five minutes'", "5m"]),
    ("rp object id", "prod", {"rpPrincipalObjectId": "not-a-guid"}, ["tiered:rpPrincipalObjectId", "'not-a-guid'", "az ad sp show --id 4392ab71"]),
    ("lifecycle order", "prod", {"coldAfterDays": "20"}, ["tiered:coldAfterDays", "20", "not after tiered:coolAfterDays (30)"]),
    ("soft delete range", "prod", {"softDeleteDays": "0"}, ["tiered:softDeleteDays", "0", "1-365"]),
    ("bad boolean", "prod", {"computeEnabled": "maybe"}, ["tiered:computeEnabled", "'maybe'", "true or false"]),
    ("data mover rate", "prod", {"dataMoverGBps": "fast"}, ["tiered:dataMoverGBps", "'fast'", "7.5"]),
    ("unknown zone", "prod", {"zone": "4"}, ["tiered:zone", "'4'", "1, 2 or 3"]),
    ("unknown key", "prod", {"nodecount": "3"}, ["tiered:nodecount", "unknown setting"]),
    ("unknown cluster mode", "prod", {"clusterMode": "k8s"}, ["tiered:clusterMode", "'k8s'", "use slurm", "or none"]),
    ("unknown access", "prod", {"access": "vpn"}, ["tiered:access", "'vpn'", "bastion", "public-ip", "none"]),
    ("public ip open to the internet", "prod", {"access": "public-ip", "sshSourcePrefix": "0.0.0.0/0"}, ["tiered:sshSourcePrefix", "'0.0.0.0/0'", "whole internet"]),
    ("public ip with a star", "prod", {"access": "public-ip", "sshSourcePrefix": "*"}, ["tiered:sshSourcePrefix", "'*'", "whole internet"]),
    ("public ip with Internet", "prod", {"access": "public-ip", "sshSourcePrefix": "Internet"}, ["tiered:sshSourcePrefix", "'Internet'", "whole internet"]),
    ("public ip with a service tag", "prod", {"access": "public-ip", "sshSourcePrefix": "VirtualNetwork"},
     ["tiered:sshSourcePrefix", "'VirtualNetwork'", "public-ip needs the CIDR", "tiered:access bastion"]),
    ("unknown login size", "prod", {"loginVmSize": "Standard_B1s"}, ["tiered:loginVmSize", "'Standard_B1s'", "Standard_D8s_v5"]),
    ("bastion subnet too small", "prod", {"bastionSubnetCidr": "10.42.1.0/27"}, ["tiered:bastionSubnetCidr", "/26"]),
    ("bastion subnet outside vnet", "prod", {"bastionSubnetCidr": "10.99.1.0/26"}, ["tiered:bastionSubnetCidr", "not inside tiered:vnetCidr"]),
    ("bastion subnet overlaps", "prod", {"bastionSubnetCidr": "10.42.4.0/26"}, ["tiered:bastionSubnetCidr", "overlaps tiered:computeSubnetCidr"]),
    ("training user", "prod", {"trainingUser": "Root!"}, ["tiered:trainingUser", "'Root!'", "Linux user name"]),
    ("training group is the service group", "prod", {"trainingGroup": "tiered-ckpt"}, ["tiered:trainingGroup", "'tiered-ckpt'", "e.g. training"]),
    ("archive cannot keep up", "prod", {"checkpointIntervalSeconds": "60"}, ["tiered:checkpointIntervalSeconds", "60", "tiered:allowArchiveBacklog true"]),
]


@pytest.mark.timeout(30)
@pytest.mark.parametrize(("case", "stack", "over", "expect"), BAD, ids=[b[0] for b in BAD])
def test_bad_config_is_refused_with_key_value_and_fix(case: str, stack: str, over: dict[str, str], expect: list[str]) -> None:
    raw = stack_config(stack, {"sshPublicKey": SSH_KEY, **over})
    with pytest.raises(schema.SettingsError) as err:
        schema.load(raw, stack)
    msg = str(err.value)
    assert "\n" not in msg
    for fragment in expect:
        assert fragment in msg, f"{case}: {fragment!r} not in {msg!r}"


@pytest.mark.timeout(30)
def test_every_problem_is_reported_at_once_one_line_each() -> None:
    bad = {"access": "public-ip", "sshSourcePrefix": "0.0.0.0/0", "clusterMode": "k8s", "loginVmSize": "Standard_B1s",
           "nodeCount": "eight", "zone": "4", "nodecount": "3"}
    with pytest.raises(schema.SettingsError) as err:
        schema.load(stack_config("prod", {"sshPublicKey": SSH_KEY, **bad}), "prod")
    lines = str(err.value).splitlines()
    assert lines == list(err.value.problems)
    named = sorted(line.split(":")[1] for line in lines)
    assert named == sorted(["sshSourcePrefix", "clusterMode", "loginVmSize", "nodeCount", "zone", "nodecount"]), lines
    assert all("; " in line for line in lines if "unknown setting" not in line)      # each: problem; fix


@pytest.mark.timeout(30)
@pytest.mark.parametrize("over", [
    {"clusterMode": "none", "sshPublicKey": "", "loginVmSize": "x", "access": "public-ip"},   # no VM of ours: nothing to check
    {"access": "public-ip", "sshSourcePrefix": "203.0.113.0/24"},
    {"access": "none", "bastionSubnetCidr": "nonsense"},      # no Bastion: its subnet is not used
])
def test_mode_specific_settings_are_checked_only_when_used(over: dict[str, str]) -> None:
    schema.load(stack_config("prod", {"sshPublicKey": SSH_KEY, **over}), "prod")


@pytest.mark.timeout(30)
def test_stack_name_that_breaks_the_amlfs_name_pattern_is_refused() -> None:
    raw = stack_config("prod", {"sshPublicKey": SSH_KEY})
    with pytest.raises(schema.SettingsError, match=r"stack name 'x{70}'.*does not match the API pattern"):
        schema.load(raw, "x" * 70)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("over", [
    {"capacityTiB": "132", "allowAboveDefaultMax": "true"},
    {"checkpointIntervalSeconds": "60", "allowArchiveBacklog": "true"},
    {"sku": "AMLFS-Durable-Premium-40", "capacityTiB": "96"},
    {"computeEnabled": "false", "sshPublicKey": "", "vmSize": "Standard_D4s_v5"},   # compute-only keys not needed when off
])
def test_explicit_overrides_and_valid_variants_pass(over: dict[str, str]) -> None:
    schema.load(stack_config("prod", {"sshPublicKey": SSH_KEY, **over}), "prod")


@pytest.mark.timeout(30)
def test_pulumi_yaml_config_is_generated_from_the_schema_and_not_stale() -> None:
    project = yaml.safe_load((ROOT / "Pulumi.yaml").read_text())
    assert project["name"] == schema.NAMESPACE
    assert project["stackConfigDir"] == "stacks"
    assert project["runtime"]["name"] == "python" and project["runtime"]["options"]["virtualenv"] == ".venv"
    # The config block is generated from the schema: a key changed in components/settings/schema.py without
    # `python -m components.settings --pulumi-yaml` leaves Pulumi.yaml stale, and this fails.
    text = (ROOT / "Pulumi.yaml").read_text()
    assert schema.pulumi_yaml(text) == text, "Pulumi.yaml is stale: run python -m components.settings --pulumi-yaml"
    declared = project["config"]
    assert list(declared) == [k.name for k in schema.SCHEMA]
    assert all(set(declared[k.name]) == {"type", "default", "description"} for k in schema.SCHEMA)


@pytest.mark.timeout(30)
def test_every_settings_field_is_a_declared_key() -> None:
    """One declaration per key: a Settings field added without key(...) is not a stack setting."""
    from dataclasses import fields

    assert [f.name for f in fields(schema.Settings) if f.name != "stack"] == [k.field for k in schema.SCHEMA]
    s = schema.load(stack_config("prod", {"sshPublicKey": SSH_KEY}), "prod")
    assert s.sku is azure.SKUS["AMLFS-Durable-Premium-500"] and s.data_mover_gbps == 7.5


@pytest.mark.timeout(30)
@pytest.mark.parametrize("stack", ["dev", "prod"])
def test_stack_files_use_only_declared_keys(stack: str) -> None:
    data = yaml.safe_load((ROOT / "stacks" / f"Pulumi.{stack}.yaml").read_text())
    for key in data["config"]:
        ns, name = key.split(":", 1)
        assert ns == "tiered" and name in schema.SCHEMA_BY_NAME, key


@pytest.mark.timeout(60)
def test_program_refuses_bad_config_before_registering_anything(plan: Plan) -> None:
    with pytest.raises(mockrun.PreviewError, match=r"^tiered:capacityTiB: 130 .*128 or 132$"):
        plan("prod", capacityTiB=130)


@pytest.mark.timeout(90)
def test_plan_script_prints_one_line_and_exits_2_without_traceback() -> None:
    env = {**os.environ, "COLUMNS": "300"}
    r = subprocess.run([sys.executable, "-m", "tiered_ops.preview", "--stack", "prod", "--set", "vmSize=Standard_D4s_v5"],
                       capture_output=True, text=True, cwd=ROOT, env=env, timeout=80)
    assert r.returncode == 2
    assert "Traceback" not in r.stderr + r.stdout
    assert "tiered:vmSize: 'Standard_D4s_v5' is not an ND-series size" in " ".join(r.stderr.split())
    r = subprocess.run([sys.executable, "-m", "tiered_ops.preview", "--stack", "nope"],
                       capture_output=True, text=True, cwd=ROOT, env=env, timeout=80)
    assert r.returncode == 2 and "Traceback" not in r.stderr and "use one of dev, prod" in " ".join(r.stderr.split())
