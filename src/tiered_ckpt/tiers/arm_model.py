"""What Azure Resource Manager says about an AMLFS file system's blob integration, as plain data.

The state vocabulary of the three blob-integration jobs, the target they run on, and the plain
records the ARM client (tiered_ckpt.tiers.arm) returns. No Azure SDK import here: the Pulumi
program (components/resources/blob_jobs.py) and the operator's teardown read the same state names.

The state names are the wire values of the Microsoft.StorageCache REST API, spec file
specification/storagecache/resource-manager/Microsoft.StorageCache/stable/<version>/amlfilesystem.json
in github.com/Azure/azure-rest-api-specs (the enums ImportStatusType, ArchiveStatusType,
AutoExportStatusType, AutoExportJobAdminStatus), which azure-mgmt-storagecache generates its
models from; tests/arm/test_job_states.py checks them against the installed SDK.
"""
from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timezone
from enum import Enum
from typing import TYPE_CHECKING, Any, NamedTuple

from tiered_ckpt.errors import ConfigError

if TYPE_CHECKING:
    from tiered_ckpt.config import NodeConfig

ARM_DEFAULT = "https://management.azure.com"
API_VERSION = "2026-08-01"   # azure-mgmt-storagecache 4.1.0's default; named in operator commands

# ---------------------------------------------------------------------------------------------
# Job states. AMLFS runs one blob-integration job (import, manual archive, auto-export) at a
# time: a BUSY state still holds that slot; every other state of the enum is terminal.

# importJobs status.state (ImportStatusType).
IMPORT_IN_PROGRESS = "InProgress"
IMPORT_BUSY = (IMPORT_IN_PROGRESS, "Cancelling")
IMPORT_COMPLETED = "Completed"
IMPORT_TERMINAL = ("Canceled", "Completed", "CompletedPartial", "Failed")

# hsm.archiveStatus[].status.state of a manual archive (ArchiveStatusType). Idle and
# NotConfigured: no archive has run (no entry at all reads as Idle).
ARCHIVE_BUSY = ("InProgress", "FSScanInProgress", "Cancelling")
ARCHIVE_COMPLETED = "Completed"
ARCHIVE_IDLE = "Idle"
ARCHIVE_ENDED_BADLY = ("Canceled", "Failed")
ARCHIVE_TERMINAL = ("NotConfigured", ARCHIVE_IDLE, ARCHIVE_COMPLETED, *ARCHIVE_ENDED_BADLY)

# autoExportJobs status.state (AutoExportStatusType) and properties.adminStatus (AutoExportJobAdminStatus).
AUTOEXPORT_RUNNING = "InProgress"
AUTOEXPORT_DISABLING = "Disabling"
AUTOEXPORT_DISABLED = "Disabled"
AUTOEXPORT_STOP_FAILED = ("DisableFailed", "Failed")
ADMIN_ENABLE = "Enable"
ADMIN_DISABLE = "Disable"

# properties.provisioningState of an auto-export or import job (AutoExportJobProvisioningStateType,
# ImportJobProvisioningStateType: Succeeded, Failed, Creating, Deleting, Updating, Canceled). A
# PATCH/PUT is still being applied while BUSY; it ended badly in FAILED.
PROVISIONING_BUSY = ("Creating", "Updating", "Deleting")
PROVISIONING_FAILED = ("Failed", "Canceled")


# ---------------------------------------------------------------------------------------------
# The target and the records


@dataclass(frozen=True)
class AmlfsTarget:
    subscription_id: str
    resource_group: str
    filesystem: str
    autoexport_job: str
    endpoint: str | None = None                    # ARM base URL override (the local double)
    managed_identity_client_id: str | None = None  # user-assigned identity of the node

    @classmethod
    def from_config(cls, cfg: NodeConfig) -> AmlfsTarget:
        a = cfg.amlfs
        values = {
            "subscription_id": a.subscription_id,
            "resource_group": a.resource_group,
            "filesystem": a.filesystem,
            "autoexport_job": a.autoexport_job,
        }
        missing = [f"amlfs.{k}" for k, v in values.items() if not v]
        if missing:
            where = f" in {cfg.source}" if cfg.source else ""
            raise ConfigError(
                f"{', '.join(missing)} not set{where}; the AMLFS back-end needs them to call Azure Resource Manager "
                "(cloud-init writes them from the stack outputs; locally, set them or use --backend local)"
            )
        return cls(
            subscription_id=str(a.subscription_id),
            resource_group=str(a.resource_group),
            filesystem=str(a.filesystem),
            autoexport_job=str(a.autoexport_job),
            endpoint=a.arm_endpoint or None,
            managed_identity_client_id=cfg.archive.managed_identity_client_id or None,
        )

    @property
    def base_url(self) -> str:
        return (self.endpoint or ARM_DEFAULT).rstrip("/")

    @property
    def filesystem_id(self) -> str:
        return (
            f"/subscriptions/{self.subscription_id}/resourceGroups/{self.resource_group}"
            f"/providers/Microsoft.StorageCache/amlFilesystems/{self.filesystem}"
        )

    @property
    def autoexport_id(self) -> str:
        return f"{self.filesystem_id}/autoExportJobs/{self.autoexport_job}"

    def admin_command(self, value: str) -> str:
        """The exact command an operator runs to set auto-export's adminStatus (Enable / Disable) by hand."""
        return (
            f"az rest --method patch --url '{self.base_url}{self.autoexport_id}?api-version={API_VERSION}' "
            f"--body '{{\"properties\": {{\"adminStatus\": \"{value}\"}}}}'"
        )

    def enable_command(self) -> str:
        """The exact command an operator runs to re-enable auto-export by hand."""
        return self.admin_command(ADMIN_ENABLE)


@dataclass(frozen=True)
class AutoExportStatus:
    admin_status: str                 # Enable | Disable (what was asked)
    state: str                        # InProgress | Disabling | Disabled | DisableFailed | Failed
    status_message: str
    last_success_utc: datetime | None  # lastSuccessfulIterationCompletionTimeUTC
    total_files_failed: int
    current_iteration_files_discovered: int
    current_iteration_files_exported: int
    current_iteration_files_failed: int
    current_iteration_mib_discovered: int = 0
    current_iteration_mib_exported: int = 0
    total_files_exported: int = 0
    total_mib_exported: int = 0
    export_iteration_count: int = 0
    provisioning_state: str = ""
    prefixes: tuple[str, ...] = ()


@dataclass(frozen=True)
class ImportResult:
    name: str
    state: str
    blobs_walked: int
    blobs_imported: int
    errors: int
    message: str
    conflicts: int = 0
    prefixes: tuple[str, ...] = ()

    @property
    def ok(self) -> bool:
        return self.state == IMPORT_COMPLETED


class ArchiveProgress(NamedTuple):
    """A manual archive (export) of one file system path: hsm.archiveStatus[]."""

    state: str            # NotConfigured | Idle | InProgress | FSScanInProgress | Cancelling | Canceled | Completed | Failed
    percent: int | None
    errors: str | None    # "errorCode: errorMessage" when the service reports one


# ---------------------------------------------------------------------------------------------
# SDK models -> records (attribute access only, so any object of the same shape parses)


def wire(v: Any) -> str:
    """A state as its wire value: the SDK answers str-enums, whose str() is "Type.MEMBER"."""
    if isinstance(v, Enum):
        return str(v.value)
    return str(v) if v is not None else ""


def _int(v: Any) -> int:
    return int(v) if v is not None else 0


def _as_utc(v: Any) -> datetime | None:
    if v is None:
        return None
    if isinstance(v, datetime):
        return v.astimezone(timezone.utc) if v.tzinfo else v.replace(tzinfo=timezone.utc)
    return datetime.fromisoformat(str(v).replace("Z", "+00:00"))


def autoexport_status_of(job: Any) -> AutoExportStatus:
    p = getattr(job, "properties", None)
    s = getattr(p, "status", None)
    g = (lambda name: getattr(s, name, None)) if s is not None else (lambda name: None)
    return AutoExportStatus(
        admin_status=wire(getattr(p, "admin_status", None)),
        state=wire(g("state")),
        status_message=wire(g("status_message")),
        last_success_utc=_as_utc(g("last_successful_iteration_completion_time_utc")),
        total_files_failed=_int(g("total_files_failed")),
        current_iteration_files_discovered=_int(g("current_iteration_files_discovered")),
        current_iteration_files_exported=_int(g("current_iteration_files_exported")),
        current_iteration_files_failed=_int(g("current_iteration_files_failed")),
        current_iteration_mib_discovered=_int(g("current_iteration_mi_b_discovered")),
        current_iteration_mib_exported=_int(g("current_iteration_mi_b_exported")),
        total_files_exported=_int(g("total_files_exported")),
        total_mib_exported=_int(g("total_mi_b_exported")),
        export_iteration_count=_int(g("export_iteration_count")),
        provisioning_state=wire(getattr(p, "provisioning_state", None)),
        prefixes=tuple(getattr(p, "auto_export_prefixes", None) or ()),
    )


def import_result_of(job: Any, name: str) -> ImportResult:
    p = getattr(job, "properties", None)
    s = getattr(p, "status", None)
    g = (lambda attr: getattr(s, attr, None)) if s is not None else (lambda attr: None)
    return ImportResult(
        name=wire(getattr(job, "name", None)) or name,
        state=wire(g("state")) or IMPORT_IN_PROGRESS,
        blobs_walked=_int(g("total_blobs_walked")),
        blobs_imported=_int(g("total_blobs_imported")),
        errors=_int(g("total_errors")),
        message=wire(g("status_message")),
        conflicts=_int(g("total_conflicts")),
        prefixes=tuple(getattr(p, "import_prefixes", None) or ()),
    )


def archive_entries_of(fs: Any) -> list[tuple[str, ArchiveProgress]]:
    """(file system path, progress) of every hsm.archiveStatus entry of a file system."""
    hsm = getattr(getattr(fs, "properties", None), "hsm", None)
    out = []
    for entry in getattr(hsm, "archive_status", None) or []:
        st = entry.status
        err = None
        if st is not None and (st.error_code or st.error_message):
            err = f"{st.error_code or 'error'}: {st.error_message or ''}".strip()
        out.append((wire(entry.filesystem_path),
                    ArchiveProgress(wire(st.state if st else None) or ARCHIVE_IDLE, st.percent_complete if st else None, err)))
    return out
