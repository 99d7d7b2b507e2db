"""The compute-off/on cycle, program side: compute off keeps exactly the archive; compute on again re-imports the checkpoints."""
from __future__ import annotations

import pytest

from tiered_ops import mockrun

from .conftest import Plan

pytestmark = pytest.mark.timeout(120)

ARCHIVE = {
    ("azure-native:resources:ResourceGroup", "tiered-archive-rg"),
    ("azure-native:storage:StorageAccount", "tiered-archive-account"),
    ("azure-native:storage:BlobServiceProperties", "tiered-archive-blob-service"),
    ("azure-native:storage:BlobContainer", "tiered-archive-data"),
    ("azure-native:storage:BlobContainer", "tiered-archive-logs"),
    ("azure-native:storage:ManagementPolicy", "tiered-archive-lifecycle"),
    ("azure-native:authorization:RoleAssignment", "tiered-archive-rp-account-contributor"),
    ("azure-native:authorization:RoleAssignment", "tiered-archive-rp-blob-data-contributor"),
    ("time:index/sleep:Sleep", "tiered-archive-role-propagation"),
}


def custom(p: mockrun.PreviewResult) -> set[tuple[str, str]]:
    return {(r.type, r.name) for r in p.resources if r.custom}


@pytest.mark.parametrize("stack", ["prod", "dev"])
def test_compute_off_keeps_exactly_the_archive(plan: Plan, stack: str) -> None:
    off = plan(stack, computeEnabled=False)
    assert custom(off) == ARCHIVE
    assert {r.type for r in off.resources if not r.custom} == {"tiered:platform:Platform", "tiered:storage:CoreStorage"}
    o = off.outputs
    assert o["computeEnabled"] is False
    for key in ("computeResourceGroup", "amlfsName", "autoExportJobName", "mgsAddress", "mountCommand", "provisionedGBps", "nodeCount"):
        assert o.get(key) is None, key
    for key in ("subscriptionId", "storageResourceGroup", "storageAccountName", "storageAccountUrl", "dataContainer",
                "loggingContainer", "dataContainerId", "checkpointPrefix"):
        assert o[key], key
    acct = off.one("azure-native:storage:StorageAccount")
    assert acct.inputs["networkRuleSet"]["defaultAction"] == "Deny" and acct.inputs["networkRuleSet"]["virtualNetworkRules"] == []


def test_compute_off_does_not_need_compute_settings(plan: Plan) -> None:
    # Between campaigns the stack may carry no SSH key and a stale size; the archive is still managed.
    p = plan("prod", computeEnabled=False, sshPublicKey="", vmSize="Standard_D2s_v5", nodeCount=0)
    assert custom(p) == ARCHIVE


def test_archive_is_the_same_resources_across_the_cycle(plan: Plan) -> None:
    on, off, again = plan("prod"), plan("prod", computeEnabled=False), plan("prod", computeEnabled=True)
    archive_of = {name: p for name, p in (("on", on), ("off", off), ("again", again))}
    ids = {name: {(r.type, r.name): (r.id, r.inputs.get("accountName"), r.inputs.get("containerName"))
                  for r in p.resources if (r.type, r.name) in ARCHIVE} for name, p in archive_of.items()}
    assert ids["on"] == ids["off"] == ids["again"]         # same logical names, same Azure names: no replacement
    for p in archive_of.values():
        assert p.one("azure-native:storage:StorageAccount", "archive").protect and p.one("azure-native:storage:BlobContainer", "data").protect
    assert on.outputs["storageAccountName"] == off.outputs["storageAccountName"] == again.outputs["storageAccountName"]


def test_compute_on_again_reimports_the_checkpoint_prefix_before_auto_export(plan: Plan) -> None:
    p = plan("prod", computeEnabled=True)
    fs = p.one("azure-native:storagecache:AmlFilesystem")
    assert fs.inputs["hsm"]["settings"]["importPrefix"] == p.outputs["checkpointPrefix"] == "/checkpoints"
    assert fs.inputs["hsm"]["settings"]["container"] == p.outputs["dataContainerId"]
    wait = p.one(mockrun.WAIT_TYPE)
    job = p.one("azure-native:storagecache:AutoExportJob")
    assert p.depends_on(job, wait) and p.depends_on(wait, fs)
    assert (wait.inputs["filesystem"], wait.inputs["resource_group"], wait.inputs["subscription_id"]) == (
        fs.state["name"], p.outputs["computeResourceGroup"], mockrun.MOCK_SUBSCRIPTION)
    assert wait.inputs["timeout_s"] == 240 * 60
    assert wait.timeouts["create"] == "250m"        # Pulumi's own timeout is longer than the wait's


def test_import_wait_is_configurable(plan: Plan) -> None:
    wait = plan("dev", blobJobWaitMinutes=30).one(mockrun.WAIT_TYPE)
    assert wait.inputs["timeout_s"] == 1800 and wait.timeouts["create"] == "40m"


def test_stack_outputs_keep_one_shape_across_the_cycle(plan: Plan) -> None:
    # Scripts read `pulumi stack output --json`: compute-side keys stay present (null) while compute is off.
    on, off = plan("prod"), plan("prod", computeEnabled=False)
    assert set(on.outputs) == set(off.outputs)
    storage_keys = {"subscriptionId", "storageResourceGroup", "storageAccountName", "storageAccountUrl", "dataContainer",
                    "loggingContainer", "dataContainerId", "checkpointPrefix", "computeEnabled", "sizing", "clusterMode"}
    # Present only for some modes: the login VM's public IP (access public-ip), the bootstrap script (clusterMode none).
    other_modes = {"loginPublicIp", "nodeBootstrapScript"}
    assert on.outputs["loginPublicIp"] is None and on.outputs["nodeBootstrapScript"] is None
    for key in set(off.outputs) - storage_keys - other_modes:
        assert off.outputs[key] is None and on.outputs[key] is not None, key
