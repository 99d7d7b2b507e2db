"""The AMLFS ARM layer (tiered_ckpt.tiers.arm) with the real azure-mgmt-storagecache client against the
local ARM double (tests/doubles/arm_double.py)."""
from __future__ import annotations

import os
import signal
import socket
from datetime import datetime, timezone

import pytest

from tests.doubles.arm_double import OPERATOR_TOKEN
from tiered_ckpt.config import AmlfsConfig, ArchiveConfig, NodeConfig
from tiered_ckpt.errors import ConfigError, ConflictError, IntegrityError, UnavailableError
from tiered_ckpt.tiers.arm import (
    AmlfsJobs,
    AmlfsTarget,
    ArmNotFoundError,
    ArmPermissionError,
    AutoExportReenableError,
    ImportJobError,
)

PREFIX = "/checkpoints/llama/global_epoch1_step100"


def patches(double) -> list[str]:
    return double.kinds("autoexport.patch")


# -- configuration ------------------------------------------------------------------------------


def test_target_from_config_names_every_missing_key():
    cfg = NodeConfig(amlfs=AmlfsConfig(subscription_id="sub", filesystem="fs1"), source="/etc/tiered-ckpt/config.yaml")
    with pytest.raises(ConfigError) as e:
        AmlfsTarget.from_config(cfg)
    msg = str(e.value)
    assert "amlfs.resource_group" in msg and "amlfs.autoexport_job" in msg and "/etc/tiered-ckpt/config.yaml" in msg
    assert "amlfs.subscription_id" not in msg and "amlfs.filesystem," not in msg


def test_target_from_config_takes_endpoint_and_managed_identity():
    cfg = NodeConfig(
        amlfs=AmlfsConfig(subscription_id="s", resource_group="rg", filesystem="fs", autoexport_job="ae", arm_endpoint="https://x/"),
        archive=ArchiveConfig(managed_identity_client_id="cid"),
    )
    t = AmlfsTarget.from_config(cfg)
    assert (t.subscription_id, t.resource_group, t.filesystem, t.autoexport_job) == ("s", "rg", "fs", "ae")
    assert t.base_url == "https://x" and t.managed_identity_client_id == "cid"


def test_from_config_reaches_the_double_with_patched_defaults(arm_env):
    cfg = NodeConfig(amlfs=AmlfsConfig(**arm_env.config_values()))
    st = AmlfsJobs.from_config(cfg).autoexport_status()
    assert st.state == "InProgress"


# -- auto-export -------------------------------------------------------------------------------------


def test_autoexport_status_parses_every_counter(arm_double, arm_jobs):
    arm_double.scenario.autoexport.update(
        totalFilesFailed=5,
        currentIterationFilesDiscovered=10,
        currentIterationFilesExported=5,
        currentIterationFilesFailed=1,
        currentIterationMiBDiscovered=4000,
        currentIterationMiBExported=500,
        lastSuccessfulIterationCompletionTimeUTC="2024-04-21T19:28:43.511Z",
        statusMessage="Auto Export is in progress",
    )
    st = arm_jobs().autoexport_status()
    assert (st.admin_status, st.state, st.status_message) == ("Enable", "InProgress", "Auto Export is in progress")
    assert st.last_success_utc == datetime(2024, 4, 21, 19, 28, 43, 511000, tzinfo=timezone.utc)
    assert st.last_success_utc.utcoffset().total_seconds() == 0
    assert (st.total_files_failed, st.current_iteration_files_discovered) == (5, 10)
    assert (st.current_iteration_files_exported, st.current_iteration_files_failed) == (5, 1)
    assert (st.current_iteration_mib_discovered, st.current_iteration_mib_exported) == (4000, 500)
    assert st.total_files_exported == 1000000 and st.prefixes == ("/",)


def test_autoexport_status_without_a_successful_iteration(arm_double, arm_jobs):
    del arm_double.scenario.autoexport["lastSuccessfulIterationCompletionTimeUTC"]
    assert arm_jobs().autoexport_status().last_success_utc is None


def test_disable_waits_until_the_service_reports_disabled(arm_double, arm_jobs):
    arm_double.scenario.disable_polls = 4
    st = arm_jobs().disable_autoexport()
    assert (st.admin_status, st.state) == ("Disable", "Disabled")
    after_patch = arm_double.kinds()[arm_double.kinds().index("autoexport.patch:Disable") :]
    # the LRO's own final GET plus our polls: at least disable_polls reads saw Disabling first
    assert after_patch.count("autoexport.get") >= 5


def test_disable_failed_is_a_clear_error_with_the_enable_command(arm_double, arm_jobs):
    arm_double.scenario.disable_result = "DisableFailed"
    with pytest.raises(UnavailableError) as e:
        arm_jobs().disable_autoexport()
    msg = str(e.value)
    assert "job1" in msg and "fs1" in msg and "DisableFailed" in msg
    assert "az rest --method patch" in msg and "autoExportJobs/job1" in msg and '"adminStatus": "Enable"' in msg


def test_disable_timeout_is_a_clear_error(arm_double, arm_jobs):
    arm_double.scenario.disable_polls = 10_000
    with pytest.raises(UnavailableError, match="still Disabling after"):
        arm_jobs(poll_interval=0.01).disable_autoexport(timeout=0.3)


def test_enable_sets_admin_status_and_resumes(arm_double, arm_jobs):
    jobs = arm_jobs()
    jobs.disable_autoexport()
    st = jobs.enable_autoexport()
    assert (st.admin_status, st.state) == ("Enable", "InProgress")
    assert patches(arm_double) == ["autoexport.patch:Disable", "autoexport.patch:Enable"]
    assert [r.body for r in arm_double.requests if r.kind.startswith("autoexport.patch")][-1] == {
        "properties": {"adminStatus": "Enable"}
    }


# -- import jobs -------------------------------------------------------------------------------------------


def test_import_prefixes_disables_imports_and_reenables_in_order(arm_double, arm_jobs):
    arm_double.scenario.import_blobs = 42
    seen: list = []
    r = arm_jobs().import_prefixes([PREFIX], conflict_mode="OverwriteIfDirty", name="restore-1", on_progress=seen.append)
    assert (r.name, r.state, r.blobs_walked, r.blobs_imported, r.errors) == ("restore-1", "Completed", 42, 42, 0)
    assert r.ok and seen[-1].state == "Completed" and seen[0].state == "InProgress"
    order = [k for k in arm_double.kinds() if k in ("autoexport.patch:Disable", "import.put", "autoexport.patch:Enable")]
    assert order == ["autoexport.patch:Disable", "import.put", "autoexport.patch:Enable"]
    put = next(r for r in arm_double.requests if r.kind == "import.put")
    assert put.path.endswith("/importJobs/restore-1")
    assert put.body["location"] == "eastus"
    assert put.body["properties"] == {"importPrefixes": [PREFIX], "conflictResolutionMode": "OverwriteIfDirty", "maximumErrors": 0}
    assert arm_double.scenario.autoexport["state"] == "InProgress"


def test_import_completed_partial_raises_with_counts_and_reenables(arm_double, arm_jobs):
    arm_double.scenario.import_result = "CompletedPartial"
    arm_double.scenario.import_blobs, arm_double.scenario.import_errors = 10, 3
    with pytest.raises(ImportJobError) as e:
        arm_jobs().import_prefixes([PREFIX], name="restore-2")
    assert isinstance(e.value, IntegrityError) and e.value.exit_code == 1
    msg = str(e.value)
    assert "restore-2" in msg and "CompletedPartial" in msg and "7 of 10 blobs imported, 3 errors" in msg and PREFIX in msg
    assert (e.value.result.blobs_imported, e.value.result.errors) == (7, 3)
    assert patches(arm_double) == ["autoexport.patch:Disable", "autoexport.patch:Enable"]
    assert arm_double.scenario.autoexport_admin == "Enable"


def test_import_failed_raises_and_reenables(arm_double, arm_jobs):
    arm_double.scenario.import_result = "Failed"
    with pytest.raises(ImportJobError, match="ended Failed: 0 of 10 blobs imported"):
        arm_jobs().import_prefixes([PREFIX])
    assert patches(arm_double)[-1] == "autoexport.patch:Enable"
    assert arm_double.scenario.autoexport["state"] == "InProgress"


@pytest.mark.parametrize("exc", [RuntimeError("verify failed"), KeyboardInterrupt()])
def test_autoexport_paused_reenables_after_an_exception_in_the_block(arm_double, arm_jobs, exc):
    jobs = arm_jobs()
    with pytest.raises(type(exc)):
        with jobs.autoexport_paused() as st:
            assert st.state == "Disabled"
            raise exc
    assert patches(arm_double) == ["autoexport.patch:Disable", "autoexport.patch:Enable"]
    assert arm_double.scenario.autoexport_admin == "Enable"


def test_ctrl_c_while_waiting_for_the_import_cancels_it_then_reenables(arm_double, arm_jobs):
    arm_double.scenario.import_polls = 1000

    seen: list = []

    def interrupt(progress):
        seen.append(progress)
        if len(seen) == 3:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        arm_jobs().import_prefixes([PREFIX], name="restore-3", on_progress=interrupt)
    kinds = arm_double.kinds()
    assert kinds.index("import.patch") < kinds.index("autoexport.patch:Enable")
    assert arm_double.import_jobs()["restore-3"]["properties"]["status"]["state"] == "Canceled"
    assert arm_double.scenario.autoexport_admin == "Enable"


def test_second_ctrl_c_during_reenable_waits_for_it(arm_double, arm_jobs):
    jobs = arm_jobs()
    real = jobs._set_admin_status

    def ctrl_c_then_patch(value):
        if value == "Enable":
            os.kill(os.getpid(), signal.SIGINT)   # the operator presses Ctrl-C again
        real(value)

    jobs._set_admin_status = ctrl_c_then_patch
    with pytest.raises(KeyboardInterrupt):
        with jobs.autoexport_paused():
            pass
    assert patches(arm_double) == ["autoexport.patch:Disable", "autoexport.patch:Enable"]
    assert arm_double.scenario.autoexport_admin == "Enable"


def test_refused_disable_is_not_reported_as_left_disabled(arm_double, arm_jobs):
    arm_double.scenario.deny.add("autoexport.patch")
    with pytest.raises(ArmPermissionError):
        arm_jobs().import_prefixes([PREFIX])
    assert patches(arm_double) == ["autoexport.patch:Disable"]
    assert "import.put" not in arm_double.kinds()


def test_disable_failed_creates_no_import_and_leaves_autoexport_enabled(arm_double, arm_jobs):
    arm_double.scenario.disable_result = "DisableFailed"
    with pytest.raises(UnavailableError, match="DisableFailed"):
        arm_jobs().import_prefixes([PREFIX])
    assert "import.put" not in arm_double.kinds()
    assert patches(arm_double) == ["autoexport.patch:Disable", "autoexport.patch:Enable"]


@pytest.mark.parametrize("how", ["lro", "http"])
def test_reenable_failure_tells_the_operator_the_command(arm_double, arm_jobs, how):
    arm_double.scenario.enable_fails = how
    with pytest.raises(AutoExportReenableError) as e:
        arm_jobs().import_prefixes([PREFIX])
    msg = str(e.value)
    assert "still DISABLED" in msg and "job1" in msg
    assert "az rest --method patch --url" in msg and arm_double.endpoint in msg and "api-version=2026-08-01" in msg
    assert arm_double.scenario.autoexport_admin == "Disable"


def test_reenable_failure_after_a_failed_import_reports_both(arm_double, arm_jobs):
    arm_double.scenario.import_result = "Failed"
    arm_double.scenario.enable_fails = "lro"
    with pytest.raises(AutoExportReenableError) as e:
        arm_jobs().import_prefixes([PREFIX], name="restore-4")
    assert "az rest" in str(e.value) and "restore-4" in str(e.value) and "ended Failed" in str(e.value)


def test_import_while_autoexport_runs_is_refused_as_a_conflict(arm_double, arm_jobs):
    with pytest.raises(ConflictError, match="one blob job"):
        arm_jobs().run_import([PREFIX])


def test_import_prefix_must_be_a_container_path(arm_jobs):
    with pytest.raises(ConfigError, match="must start with '/'"):
        arm_jobs().run_import(["checkpoints/x"])


def test_running_blob_jobs_lists_imports_and_archive(arm_double, arm_jobs):
    jobs = arm_jobs(token=OPERATOR_TOKEN)
    assert jobs.running_blob_jobs() == []
    arm_double.scenario.autoexport["state"] = "Disabled"
    arm_double.scenario.import_polls = 1000
    from azure.mgmt.storagecache.models import ImportJob, ImportJobProperties

    jobs.client.import_jobs.begin_create_or_update(
        "scgroup", "fs1", "other", ImportJob(location="eastus", properties=ImportJobProperties(import_prefixes=["/x"])),
        polling=False,
    ).result()
    assert jobs.running_blob_jobs() == ["importJobs/other (InProgress)"]
    with pytest.raises(ConflictError):
        jobs.start_archive("/")


# -- manual archive (the operator's: teardown runs it, the node role cannot) --------------------------------------------------------------------------------------------


def test_archive_runs_after_disable_and_reports_progress(arm_double, arm_jobs):
    archived: list[str] = []
    arm_double.scenario.archive_polls = 3
    arm_double.scenario.archive_hook = archived.append
    jobs = arm_jobs(token=OPERATOR_TOKEN)
    assert jobs.archive_status().state == "Idle"
    with pytest.raises(ConflictError):
        jobs.start_archive("/checkpoints")          # auto-export is a blob job too
    jobs.disable_autoexport()
    jobs.start_archive("/checkpoints")
    post = next(r for r in arm_double.requests if r.kind == "archive.post")
    assert post.body == {"filesystemPath": "/checkpoints"}
    first = jobs.archive_status("/checkpoints")
    assert first.state == "InProgress" and first.percent is not None and first.percent < 100
    assert any(j.startswith("archive /checkpoints (InProgress") for j in jobs.running_blob_jobs())
    seen: list = []
    done = jobs.wait_archive("/checkpoints", on_progress=seen.append)
    assert done == ("Completed", 100, None) and archived == ["/checkpoints"]
    assert [p.percent for p in seen] == sorted(p.percent for p in seen)


def test_archive_failure_is_reported_with_the_service_error(arm_double, arm_jobs):
    arm_double.scenario.archive_result = "Failed"
    jobs = arm_jobs(token=OPERATOR_TOKEN)
    jobs.disable_autoexport()
    jobs.start_archive("/")
    with pytest.raises(UnavailableError, match="ended Failed: ArchiveFailed: Archive failed"):
        jobs.wait_archive("/")


def test_cancel_archive(arm_double, arm_jobs):
    jobs = arm_jobs(token=OPERATOR_TOKEN)
    arm_double.scenario.archive_polls = 1000
    jobs.disable_autoexport()
    jobs.start_archive("/")
    jobs.cancel_archive()
    assert jobs.archive_status("/").state == "Canceled"


# -- faults -----------------------------------------------------------------------------------------------------


def test_transient_503_is_retried_by_the_client(arm_double, arm_jobs):
    arm_double.scenario.fail_next("autoexport.get", 503, 503)
    assert arm_jobs().autoexport_status().state == "InProgress"
    assert arm_double.kinds("autoexport.get") == ["autoexport.get"] * 3
    assert [r.status for r in arm_double.requests] == [503, 503, 200]


def test_transient_503_on_the_disable_patch_is_retried(arm_double, arm_jobs):
    arm_double.scenario.fail_next("autoexport.patch", 503)
    assert arm_jobs().disable_autoexport().state == "Disabled"
    assert [r.status for r in arm_double.requests if r.kind == "autoexport.patch:Disable"] == [503, 202]


def test_persistent_5xx_becomes_unavailable(arm_double, arm_jobs):
    arm_double.scenario.fail_next("fs.get", *[500] * 10)
    with pytest.raises(UnavailableError, match="kept failing after retries"):
        arm_jobs().archive_status()


def test_arm_unreachable_is_a_clear_error(arm_double, arm_jobs):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    target = arm_double.target(endpoint=f"https://127.0.0.1:{port}")
    with pytest.raises(UnavailableError) as e:
        arm_jobs(target).autoexport_status()
    msg = str(e.value)
    assert "unreachable" in msg and f"https://127.0.0.1:{port}" in msg and e.value.exit_code == 3


def test_missing_role_names_the_permission(arm_double, arm_jobs):
    arm_double.scenario.deny.add("autoexport.patch")
    with pytest.raises(ArmPermissionError) as e:
        arm_jobs().disable_autoexport()
    msg = str(e.value)
    assert "403" in msg and "AuthorizationFailed" in msg and "autoExportJobs/write" in msg and "docs/arm.md" in msg


def test_wrong_job_name_says_which_setting_to_check(arm_double, arm_jobs):
    with pytest.raises(ArmNotFoundError) as e:
        arm_jobs(arm_double.target(autoexport_job="nosuchjob")).autoexport_status()
    msg = str(e.value)
    assert "nosuchjob" in msg and "amlfs.autoexport_job" in msg and "ResourceNotFound" in msg
