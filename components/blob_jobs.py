"""WaitForBlobJobs: a Pulumi dynamic resource that waits until a file system runs no blob-integration job.

Why: AMLFS runs one blob-integration job at a time (import, manual export, auto-export). A new file
system starts an import job for hsm.settings.importPrefix at creation, and that job can still run
after ARM reports the file system created. Creating the AutoExportJob then fails. On the "coming
back" path (compute side on again over an existing archive) that import re-creates every archived
checkpoint as released stubs and can take a long time, so `pulumi up` would fail without this wait.
The AutoExportJob depends on this resource, so `pulumi up` succeeds without manual retries.

The provider is pickled into the Pulumi state by value (pulumi/pulumi#7755), so everything it uses
lives on the class (static methods) and Azure SDK imports happen inside `create`.
"""
from __future__ import annotations

import inspect
import time
from collections.abc import Callable, Iterable
from typing import Any

import pulumi
import pulumi.dynamic

from tiered_ckpt.tiers.arm_model import ARCHIVE_BUSY, IMPORT_BUSY


class WaitForBlobJobsProvider(pulumi.dynamic.ResourceProvider):
    # Import job states in which the job still holds the file system's single blob-job slot, and
    # hsm.archiveStatus states of a manual export that is still running (the REST spec's enums, in
    # tiered_ckpt.tiers.arm_model). Copied onto the class so that they travel with the pickled provider.
    BUSY_IMPORT = IMPORT_BUSY
    BUSY_ARCHIVE = ARCHIVE_BUSY

    @classmethod
    def busy(cls, import_states: Iterable[str | None], archive_states: Iterable[str | None]) -> list[str]:
        """Names of what still runs (empty = idle). Unknown/None states count as not running."""
        out = [f"import job {s}" for s in import_states if s in cls.BUSY_IMPORT]
        out += [f"archive {s}" for s in archive_states if s in cls.BUSY_ARCHIVE]
        return out

    @classmethod
    def wait_idle(cls, probe: Callable[[], tuple[list[str | None], list[str | None]]], timeout_s: float, poll_s: float,
                  settle: int = 2, clock: Callable[[], float] = time.monotonic,
                  sleep: Callable[[float], None] = time.sleep) -> dict[str, Any]:
        """Poll until `settle` consecutive probes show no running job, or raise TimeoutError.

        `settle` > 1 because the creation-time import job may be listed a little after the file system
        reports success; one idle look right after creation is not proof.
        """
        start = clock()
        idle_in_row, probes = 0, 0
        while True:
            imports, archives = probe()
            probes += 1
            last = cls.busy(imports, archives)
            idle_in_row = 0 if last else idle_in_row + 1
            if idle_in_row >= settle:
                return {"probes": probes, "waited_s": round(clock() - start, 1),
                        "import_states": [s or "" for s in imports]}
            if clock() - start >= timeout_s:
                raise TimeoutError(f"still running after {timeout_s:.0f} s: {', '.join(last) or 'not yet settled'}; "
                                   "run `pulumi up` again once it finishes, or raise tiered:blobJobWaitMinutes")
            sleep(poll_s)

    @classmethod
    def probe_for(cls, client: Any, resource_group: str, filesystem: str) -> Callable[[], tuple[list[str | None], list[str | None]]]:
        """A probe reading import job states and hsm.archiveStatus states through a StorageCacheManagementClient."""

        def probe() -> tuple[list[str | None], list[str | None]]:
            imports = []
            for job in client.import_jobs.list_by_aml_filesystem(resource_group, filesystem):
                status = getattr(getattr(job, "properties", None), "status", None)
                imports.append(cls.plain(getattr(status, "state", None)))
            hsm = getattr(getattr(client.aml_filesystems.get(resource_group, filesystem), "properties", None), "hsm", None)
            archives = [cls.plain(getattr(getattr(a, "status", None), "state", None)) for a in (getattr(hsm, "archive_status", None) or [])]
            return imports, archives

        return probe

    @staticmethod
    def plain(state: Any) -> str | None:
        """The SDK answers str-enums (ImportStatusType.IN_PROGRESS); keep the wire value ("InProgress")."""
        return None if state is None else str(getattr(state, "value", state))

    def create(self, props: dict[str, Any]) -> pulumi.dynamic.CreateResult:
        from azure.identity import DefaultAzureCredential
        from azure.mgmt.storagecache import StorageCacheManagementClient

        # Runs in the dynamic provider host with the operator's Azure login (az CLI, env, managed identity).
        client = StorageCacheManagementClient(DefaultAzureCredential(), props["subscription_id"])
        rg, fs = props["resource_group"], props["filesystem"]
        result = self.wait_idle(self.probe_for(client, rg, fs), float(props["timeout_s"]), float(props["poll_s"]))
        return pulumi.dynamic.CreateResult(id_=f"{rg}/{fs}/blob-jobs-idle", outs={**props, **result})

    def diff(self, _id: str, olds: dict[str, Any], news: dict[str, Any]) -> pulumi.dynamic.DiffResult:
        # Waiting again only makes sense for a different file system (a replacement re-imports).
        keys = ("subscription_id", "resource_group", "filesystem", "filesystem_id")
        changed = [k for k in keys if olds.get(k) != news.get(k)]
        return pulumi.dynamic.DiffResult(changes=bool(changed), replaces=changed, delete_before_replace=True)

    def delete(self, _id: str, _props: dict[str, Any]) -> None:
        return None  # nothing exists in Azure for this resource


class WaitForBlobJobs(pulumi.dynamic.Resource, module="tiered", name="WaitForBlobJobs"):
    """Completes once the file system has no import/manual-export job running."""

    import_states: pulumi.Output[list[str]]

    def __init__(self, name: str, *, subscription_id: pulumi.Input[str], resource_group: pulumi.Input[str],
                 filesystem: pulumi.Input[str], filesystem_id: pulumi.Input[str], timeout_s: int, poll_s: int = 30,
                 opts: pulumi.ResourceOptions | None = None) -> None:
        super().__init__(
            WaitForBlobJobsProvider(), name,
            {"subscription_id": subscription_id, "resource_group": resource_group, "filesystem": filesystem,
             "filesystem_id": filesystem_id, "timeout_s": timeout_s, "poll_s": poll_s, "import_states": None},
            opts)


def _pickle_by_value(cls: type) -> None:
    """Make dill serialize `cls` by value into the Pulumi state.

    dill pickles importable classes by reference; the dynamic provider host then has to import
    `components.blob_jobs`, which works only if it happens to start in the project directory.
    Marking the class and its functions as `__main__` members (not found there) makes dill embed them.
    """
    cls.__module__ = "__main__"
    for value in vars(cls).values():
        func = getattr(value, "__func__", value)
        if inspect.isfunction(func):
            func.__module__ = "__main__"


_pickle_by_value(WaitForBlobJobsProvider)
