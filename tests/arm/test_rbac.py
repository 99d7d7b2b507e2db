"""ARM's role-based access control, as the double enforces it, against the roles the program assigns.

The node identity's grants come from the real Pulumi program (tests/doubles/program_roles.py), so a
missing action (restore fails on the nodes) or an extra one (more privilege than the toolkit uses)
fails here, not in a subscription.
"""
from __future__ import annotations

import pytest

from tests.doubles.arm_double import NODE_TOKEN, OPERATOR_TOKEN, Grant
from tests.doubles.program_roles import node_grants
from tiered_ckpt.errors import UnavailableError
from tiered_ckpt.tiers.arm import ArmPermissionError

PREFIX = "/checkpoints/llama/global_epoch1_step100/"
FS_ACTIONS = "Microsoft.StorageCache/"


def without(double, action: str) -> None:
    """Re-grant the node identity the program's roles minus `action`."""
    double.grants[NODE_TOKEN] = [Grant(tuple(a for a in g.actions if a.lower() != action.lower()), g.scope, g.not_actions)
                                 for g in node_grants(double)]


def test_restore_with_the_node_role_needs_no_subscription_scoped_read(arm_double, arm_jobs):
    # The SDK's LRO poller reads .../locations/{loc}/ascOperations/{id} at subscription scope; a role
    # assigned at the file system cannot, so a restore that polls it fails after disabling export.
    result = arm_jobs().import_prefixes([PREFIX])
    assert result.state == "Completed"
    assert "asyncop.get" not in arm_double.kinds()
    assert arm_double.kinds("autoexport.patch") == ["autoexport.patch:Disable", "autoexport.patch:Enable"]
    assert arm_double.scenario.autoexport_admin == "Enable"
    assert all(r.status < 400 for r in arm_double.requests)


def test_the_subscription_scoped_operation_is_refused_to_the_node_and_allowed_to_the_operator(arm_double, arm_jobs):
    from azure.core.exceptions import HttpResponseError

    def poll(token: str) -> None:
        from azure.mgmt.storagecache.models import AutoExportJobUpdate, AutoExportJobUpdateProperties

        jobs = arm_jobs(token=token)
        body = AutoExportJobUpdate(properties=AutoExportJobUpdateProperties(admin_status="Enable"))
        jobs.client.auto_export_jobs.begin_update("scgroup", "fs1", "job1", body, polling_interval=0.01).result()

    with pytest.raises(HttpResponseError, match="ascoperations/read"):
        poll(NODE_TOKEN)
    poll(OPERATOR_TOKEN)


def test_the_node_role_cannot_archive(arm_double, arm_jobs):
    arm_double.scenario.autoexport["state"] = "Disabled"
    with pytest.raises(ArmPermissionError) as e:
        arm_jobs().start_archive("/")
    assert "amlFilesystems/archive/action" in str(e.value)
    arm_jobs(token=OPERATOR_TOKEN).start_archive("/")


def test_an_identity_without_a_role_reads_nothing(arm_jobs):
    with pytest.raises(ArmPermissionError):
        arm_jobs(token="someone-else").autoexport_status()


def test_without_autoexport_write_a_restore_changes_nothing(arm_double, arm_jobs):
    without(arm_double, "Microsoft.StorageCache/amlFilesystems/autoExportJobs/write")
    with pytest.raises(ArmPermissionError, match="autoExportJobs/write"):
        arm_jobs().import_prefixes([PREFIX])
    assert "import.put" not in arm_double.kinds() and arm_double.scenario.autoexport_admin == "Enable"


def test_without_import_write_the_restore_fails_and_export_is_re_enabled(arm_double, arm_jobs):
    without(arm_double, "Microsoft.StorageCache/amlFilesystems/importJobs/write")
    with pytest.raises(ArmPermissionError, match="importJobs/write"):
        arm_jobs().import_prefixes([PREFIX])
    assert arm_double.kinds("autoexport.patch") == ["autoexport.patch:Disable", "autoexport.patch:Enable"]
    assert arm_double.scenario.autoexport_admin == "Enable"


def test_the_node_role_holds_exactly_the_actions_the_toolkit_uses(arm_double, arm_jobs):
    """Least privilege: every StorageCache action of the node's role is used by what nodes run
    (restore through an import, a cancelled import, status, the busy-job check), and nothing else."""
    jobs = arm_jobs()
    jobs.autoexport_status()
    jobs.running_blob_jobs()
    jobs.import_prefixes([PREFIX])
    arm_double.scenario.import_polls = 1000
    arm_double.scenario.autoexport["state"] = "Disabled"
    with pytest.raises(UnavailableError, match="asked to cancel"):
        jobs.run_import([PREFIX], timeout=0.05)        # gives up waiting: the job is cancelled
    used = {a.lower() for t, a in arm_double.authorized if t == NODE_TOKEN}
    granted = {a.lower() for g in node_grants(arm_double) for a in g.actions if a.startswith(FS_ACTIONS)}
    assert granted == used, f"granted but unused: {sorted(granted - used)}; used but not granted: {sorted(used - granted)}"


@pytest.mark.parametrize(("grant", "action", "resource", "allowed"), [
    (Grant(("Microsoft.StorageCache/amlFilesystems/read",), "/subscriptions/s/resourceGroups/g/providers/Microsoft.StorageCache/amlFilesystems/fs1"),
     "Microsoft.StorageCache/amlFilesystems/read", "/subscriptions/s/resourceGroups/g/providers/Microsoft.StorageCache/amlFilesystems/fs1", True),
    # a scope covers its children, never a sibling whose name merely starts the same
    (Grant(("Microsoft.StorageCache/*",), "/subscriptions/s/resourceGroups/g/providers/Microsoft.StorageCache/amlFilesystems/fs1"),
     "Microsoft.StorageCache/amlFilesystems/read", "/subscriptions/s/resourceGroups/g/providers/Microsoft.StorageCache/amlFilesystems/fs10", False),
    (Grant(("Microsoft.StorageCache/*",), "/subscriptions/s/resourceGroups/g"),
     "microsoft.storagecache/amlfilesystems/importjobs/write", "/subscriptions/s/resourcegroups/G/providers/Microsoft.StorageCache/amlFilesystems/fs1/importJobs/j", True),
    (Grant(("*",), "/subscriptions/s", ("Microsoft.StorageCache/amlFilesystems/archive/action",)),
     "Microsoft.StorageCache/amlFilesystems/archive/action", "/subscriptions/s/resourceGroups/g/providers/Microsoft.StorageCache/amlFilesystems/fs1/archive", False),
    (Grant(("Microsoft.StorageCache/amlFilesystems/read",), "/subscriptions/s/resourceGroups/g/providers/Microsoft.StorageCache/amlFilesystems/fs1"),
     "Microsoft.StorageCache/locations/ascoperations/read", "/subscriptions/s/providers/Microsoft.StorageCache/locations/eastus/ascOperations/1", False),
])
def test_grant_semantics(grant: Grant, action: str, resource: str, allowed: bool) -> None:
    assert grant.allows(action, resource) is allowed
