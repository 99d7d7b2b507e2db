"""WaitForBlobJobs: the polling decision (pure) and its survival in the Pulumi state."""
from __future__ import annotations

import base64
import subprocess
import sys
from pathlib import Path

import pytest
from pulumi.dynamic.dynamic import serialize_provider

from components.resources.blob_jobs import WaitForBlobJobsProvider as P

pytestmark = pytest.mark.timeout(60)


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0
        self.sleeps: list[float] = []

    def __call__(self) -> float:
        return self.now

    def sleep(self, s: float) -> None:
        self.sleeps.append(s)
        self.now += s


def seq(*steps: tuple[list[str | None], list[str | None]]):  # type: ignore[no-untyped-def]
    it = iter(steps)
    return lambda: next(it)


@pytest.mark.parametrize(("imports", "archives", "busy"), [
    ([], [], []),
    (["Completed", "CompletedPartial", "Failed", "Canceled"], ["Completed", "Idle", "NotConfigured"], []),
    (["InProgress"], [], ["import job InProgress"]),
    (["Completed", "Cancelling"], [], ["import job Cancelling"]),
    ([], ["InProgress"], ["archive InProgress"]),
    ([], ["FSScanInProgress"], ["archive FSScanInProgress"]),
    ([None], [None], []),
])
def test_busy_decision(imports: list[str | None], archives: list[str | None], busy: list[str]) -> None:
    assert P.busy(imports, archives) == busy


def test_waits_while_the_creation_import_runs_then_needs_two_idle_looks() -> None:
    clock = FakeClock()
    probe = seq((["InProgress"], []), (["InProgress"], []), (["Completed"], ["Idle"]), (["Completed"], ["Idle"]))
    out = P.wait_idle(probe, timeout_s=3600, poll_s=30, clock=clock, sleep=clock.sleep)
    assert out["probes"] == 4 and clock.sleeps == [30, 30, 30] and out["import_states"] == ["Completed"]


def test_a_job_appearing_after_one_idle_look_resets_the_count() -> None:
    # The creation-time import may be listed only after the file system reports success.
    clock = FakeClock()
    probe = seq(([], []), (["InProgress"], []), ([], []), (["Completed"], []))
    out = P.wait_idle(probe, timeout_s=3600, poll_s=10, clock=clock, sleep=clock.sleep)
    assert out["probes"] == 4


def test_times_out_naming_what_still_runs() -> None:
    clock = FakeClock()
    with pytest.raises(TimeoutError, match=r"still running after 60 s: import job InProgress.*tiered:blobJobWaitMinutes"):
        P.wait_idle(lambda: (["InProgress"], []), timeout_s=60, poll_s=30, clock=clock, sleep=clock.sleep)
    assert clock.now == 60


def test_diff_replaces_only_for_a_different_file_system() -> None:
    old = {"subscription_id": "s", "resource_group": "rg", "filesystem": "fs", "filesystem_id": "/x/fs", "timeout_s": 60}
    assert not P().diff("id", old, {**old, "timeout_s": 120}).changes
    d = P().diff("id", old, {**old, "filesystem_id": "/x/fs2"})
    assert d.changes and d.replaces == ["filesystem_id"]


def test_provider_deserializes_without_the_project_on_the_path(tmp_path: Path) -> None:
    # The dynamic provider host loads the provider from the state; it must not need `components` importable.
    blob = serialize_provider(P())
    code = ("import base64, dill, sys; p = dill.loads(base64.b64decode(sys.stdin.read())); "
            "print(p.busy(['InProgress'], []), type(p).__name__)")
    r = subprocess.run([sys.executable, "-c", code], input=blob, capture_output=True, text=True, cwd=tmp_path,
                       env={"PATH": "/usr/bin:/bin"}, timeout=50)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "['import job InProgress'] WaitForBlobJobsProvider"
    assert base64.b64decode(blob)


def _client(arm_double):  # type: ignore[no-untyped-def]
    from azure.mgmt.storagecache import StorageCacheManagementClient

    from tests.doubles.arm_double import OPERATOR_TOKEN, StaticTokenCredential

    return StorageCacheManagementClient(StaticTokenCredential(OPERATOR_TOKEN), arm_double.subscription_id, base_url=arm_double.endpoint,
                                        connection_verify=str(arm_double.ca_cert), retry_total=1)


def test_waits_for_a_running_import_through_the_real_client(arm_double) -> None:  # type: ignore[no-untyped-def]
    # The creation-time import of a new file system, as ARM reports it (REST-shaped double, real SDK client).
    from azure.mgmt.storagecache.models import ImportJob, ImportJobProperties

    arm_double.scenario.one_blob_job = False      # the new file system has no auto-export yet
    arm_double.scenario.import_polls = 3
    client = _client(arm_double)
    client.import_jobs.begin_create_or_update(
        arm_double.resource_group, arm_double.filesystem, "creation-import",
        ImportJob(location="eastus", properties=ImportJobProperties(import_prefixes=["/checkpoints"]))).result()
    probe = P.probe_for(client, arm_double.resource_group, arm_double.filesystem)
    assert P.busy(*probe()) == ["import job InProgress"]
    out = P.wait_idle(probe, timeout_s=10, poll_s=0.01)
    assert out["import_states"] == ["Completed"] and out["probes"] >= 3


def test_waits_for_a_running_manual_archive_through_the_real_client(arm_double) -> None:  # type: ignore[no-untyped-def]
    from azure.mgmt.storagecache.models import AmlFilesystemArchiveInfo

    arm_double.scenario.one_blob_job = False
    client = _client(arm_double)
    client.aml_filesystems.archive(arm_double.resource_group, arm_double.filesystem, AmlFilesystemArchiveInfo(filesystem_path="/"))
    probe = P.probe_for(client, arm_double.resource_group, arm_double.filesystem)
    assert P.busy(*probe())[0].startswith("archive ")
    P.wait_idle(probe, timeout_s=10, poll_s=0.01)
    assert not P.busy(*probe())


def test_busy_states_are_the_node_toolkits_and_the_rest_specs() -> None:
    # One definition (tiered_ckpt.tiers.arm_model), no spelling outside the spec's enums ("Canceling" is not one).
    from azure.mgmt.storagecache.models import ArchiveStatusType, ImportStatusType

    from tiered_ckpt.tiers import arm_model

    assert P.BUSY_IMPORT == arm_model.IMPORT_BUSY and P.BUSY_ARCHIVE == arm_model.ARCHIVE_BUSY
    for s in ImportStatusType:
        assert bool(P.busy([s.value], [])) == (s.value not in arm_model.IMPORT_TERMINAL), s
    for s in ArchiveStatusType:
        assert bool(P.busy([], [s.value])) == (s.value not in arm_model.ARCHIVE_TERMINAL), s
    assert P.busy(["Canceling"], ["Canceling"]) == []
