"""Azure Resource Manager calls for the AMLFS tier: auto-export, import jobs, manual archive.

Built only on azure-mgmt-storagecache (its pipeline does retries with backoff, LRO polling and
ARM error parsing) and azure-identity (the node's managed identity, or whatever
DefaultAzureCredential finds on a workstation). Every Azure failure leaves this module as a
UserError subclass with one message that names the resource and the fix.

AMLFS runs only one blob-integration job (import, manual archive, auto-export) at a time, so an
import first disables auto-export, waits until the service reports Disabled, imports, and
re-enables auto-export in a `finally` (also on Ctrl-C): `AmlfsJobs.import_prefixes`.
"""
from __future__ import annotations

import signal
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime, timezone
from enum import Enum
from typing import Any, NamedTuple, TypeVar

from azure.core.exceptions import (
    ClientAuthenticationError,
    HttpResponseError,
    ResourceNotFoundError,
    ServiceRequestError,
    ServiceResponseError,
)

from tiered_ckpt.config import NodeConfig
from tiered_ckpt.errors import ConfigError, ConflictError, IntegrityError, UnavailableError, UserError
from tiered_ckpt.redact import redact

T = TypeVar("T")

ARM_DEFAULT = "https://management.azure.com"
API_VERSION = "2026-08-01"   # azure-mgmt-storagecache 4.1.0's default; named in operator commands

# Defaults a test (or a future setting) may change for every AmlfsJobs built without explicit values:
# how often to poll job state, how long to wait, and azure-core client options (retry policy).
DEFAULT_POLL_INTERVAL = 10.0
DEFAULT_TIMEOUT = 3600.0
CLIENT_DEFAULTS: dict[str, Any] = {"retry_total": 5, "retry_backoff_factor": 0.8, "retry_backoff_max": 60}

# Import job states (ImportStatusType). Terminal ones end the wait.
IMPORT_RUNNING = ("InProgress", "Cancelling")
IMPORT_OK = "Completed"
IMPORT_TERMINAL = ("Completed", "CompletedPartial", "Failed", "Canceled")
# Manual archive states (ArchiveStatusType) that mean a blob job is still running.
ARCHIVE_RUNNING = ("InProgress", "Cancelling", "FSScanInProgress")


class ArmPermissionError(ConfigError):
    """The identity cannot get a token, or ARM refused the call (401/403)."""


class ArmNotFoundError(ConfigError):
    """The file system or job named in the config does not exist (404)."""


class ImportJobError(IntegrityError):
    """An import job ended CompletedPartial, Failed or Canceled; `.result` has the counts."""

    def __init__(self, message: str, result: ImportResult) -> None:
        super().__init__(message)
        self.result = result


class AutoExportReenableError(UnavailableError):
    """Auto-export could not be re-enabled after an import: the operator must do it by hand."""


# ---------------------------------------------------------------------------------------------
# Plain data


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

    def enable_command(self) -> str:
        """The exact command an operator runs to re-enable auto-export by hand."""
        return (
            f"az rest --method patch --url '{self.base_url}{self.autoexport_id}?api-version={API_VERSION}' "
            "--body '{\"properties\": {\"adminStatus\": \"Enable\"}}'"
        )


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
        return self.state == IMPORT_OK


class ArchiveProgress(NamedTuple):
    """A manual archive (export) of one file system path: hsm.archiveStatus[]."""

    state: str            # NotConfigured | Idle | InProgress | FSScanInProgress | Cancelling | Canceled | Completed | Failed
    percent: int | None
    errors: str | None    # "errorCode: errorMessage" when the service reports one


# ---------------------------------------------------------------------------------------------
# Azure errors -> user errors


def _arm_message(err: HttpResponseError) -> str:
    code = getattr(getattr(err, "error", None), "code", None)
    msg = getattr(getattr(err, "error", None), "message", None)
    if code or msg:
        return f"{code or 'error'}: {msg or ''}".strip()
    return str(err.message or err).splitlines()[0]


def _translate(err: Exception, target: AmlfsTarget, what: str, resource: str) -> UserError:
    """One clear message per Azure failure; `what` is the action, `resource` the ARM id.

    Credentials are removed: an identity or SDK error can quote a token or a signed URL.
    """
    e = _translate_raw(err, target, what, resource)
    clean = redact(str(e))
    return e if clean == str(e) else type(e)(clean, exit_code=e.exit_code)


def _translate_raw(err: Exception, target: AmlfsTarget, what: str, resource: str) -> UserError:
    ep = target.base_url
    if isinstance(err, ClientAuthenticationError) and err.response is None:
        ident = (
            f"the managed identity with client id {target.managed_identity_client_id}"
            if target.managed_identity_client_id
            else "DefaultAzureCredential (managed identity on a node, `az login` on a workstation)"
        )
        return ArmPermissionError(
            f"cannot {what}: no Azure token from {ident}: {str(err).splitlines()[0]}; "
            "check the node's identity (archive.managed_identity_client_id) or log in with `az login`"
        )
    if isinstance(err, (ServiceRequestError, ServiceResponseError)):
        return UnavailableError(
            f"cannot {what}: Azure Resource Manager at {ep} is unreachable after retries "
            f"({str(err).splitlines()[0]}); check the node's network/DNS and outbound HTTPS to {ep}, then re-run"
        )
    if isinstance(err, HttpResponseError):
        status = err.status_code
        detail = _arm_message(err)
        if status in (401, 403):
            return ArmPermissionError(
                f"cannot {what}: Azure Resource Manager refused it ({status} {detail}) for {resource}; "
                "the node identity needs the tiered-ckpt node role on the file system "
                "(Microsoft.StorageCache/amlFilesystems/read, .../importJobs/read, /write and /delete, "
                ".../autoExportJobs/read and /write; an operator's manual export also needs .../archive/action); "
                "see docs/arm.md"
            )
        if status == 404 or isinstance(err, ResourceNotFoundError):
            return ArmNotFoundError(
                f"cannot {what}: {resource} does not exist ({detail}); check amlfs.subscription_id, "
                "amlfs.resource_group, amlfs.filesystem and amlfs.autoexport_job in the node config against the stack outputs"
            )
        if status == 409:
            return ConflictError(
                f"cannot {what}: the service refused it because of a conflict ({detail}); AMLFS runs one blob job "
                "(import, archive, auto-export) at a time: wait for the running one (tiered-ckpt status) and re-run"
            )
        if status is not None and status >= 500:
            return UnavailableError(
                f"cannot {what}: Azure Resource Manager kept failing after retries ({status} {detail}) for {resource}; "
                "re-run later; check Azure status for Microsoft.StorageCache in the region"
            )
        if status is None:
            # An LRO that ended Failed/Canceled: azure-core raises HttpResponseError without a status.
            return UnavailableError(f"cannot {what}: the operation on {resource} failed in the service: {detail}")
        return UserError(f"cannot {what}: Azure Resource Manager rejected the request ({status} {detail}) for {resource}")
    return UserError(f"cannot {what}: {type(err).__name__}: {err}")


_AZURE_ERRORS = (ClientAuthenticationError, HttpResponseError, ServiceRequestError, ServiceResponseError)


# ---------------------------------------------------------------------------------------------


def _int(v: Any) -> int:
    return int(v) if v is not None else 0


def _str(v: Any) -> str:
    # The SDK returns str-based enums; str() of those is "Type.MEMBER", the wire value is .value.
    if isinstance(v, Enum):
        return str(v.value)
    return str(v) if v is not None else ""


def _as_utc(v: Any) -> datetime | None:
    if v is None:
        return None
    if isinstance(v, datetime):
        return v.astimezone(timezone.utc) if v.tzinfo else v.replace(tzinfo=timezone.utc)
    return datetime.fromisoformat(str(v).replace("Z", "+00:00"))


def default_credential(target: AmlfsTarget) -> Any:
    """The node's user-assigned managed identity when configured, else DefaultAzureCredential."""
    from azure.identity import DefaultAzureCredential, ManagedIdentityCredential

    if target.managed_identity_client_id:
        return ManagedIdentityCredential(client_id=target.managed_identity_client_id)
    return DefaultAzureCredential()


def make_client(target: AmlfsTarget, credential: Any = None, **client_options: Any) -> Any:
    """A StorageCacheManagementClient for `target`. `client_options` go to azure-core
    (retry_total, retry_backoff_factor, connection_verify, connection_timeout, ...)."""
    from azure.mgmt.storagecache import StorageCacheManagementClient

    if credential is None:
        credential = default_credential(target)
    kwargs: dict[str, Any] = dict(CLIENT_DEFAULTS)
    kwargs.update(client_options)
    return StorageCacheManagementClient(credential, target.subscription_id, base_url=target.base_url, **kwargs)


class AmlfsJobs:
    """Auto-export, import and archive on one AMLFS file system through ARM."""

    def __init__(
        self,
        target: AmlfsTarget,
        credential: Any = None,
        *,
        poll_interval: float | None = None,
        timeout: float | None = None,
        client: Any = None,
        client_options: dict[str, Any] | None = None,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        self.target = target
        self.poll_interval = DEFAULT_POLL_INTERVAL if poll_interval is None else poll_interval
        self.timeout = DEFAULT_TIMEOUT if timeout is None else timeout
        self._sleep = sleep
        self.client = client if client is not None else make_client(target, credential, **(client_options or {}))

    @classmethod
    def from_config(cls, cfg: NodeConfig, credential: Any = None, **kwargs: Any) -> AmlfsJobs:
        return cls(AmlfsTarget.from_config(cfg), credential, **kwargs)

    # -- helpers ------------------------------------------------------------------------------

    def _call(self, what: str, resource: str, fn: Callable[[], T]) -> T:
        try:
            return fn()
        except _AZURE_ERRORS as e:
            raise _translate(e, self.target, what, resource) from None

    def _import_id(self, name: str) -> str:
        return f"{self.target.filesystem_id}/importJobs/{name}"

    # -- auto-export ----------------------------------------------------------------------------

    def autoexport_status(self) -> AutoExportStatus:
        t = self.target
        job = self._call(
            f"read auto-export job {t.autoexport_job}",
            t.autoexport_id,
            lambda: self.client.auto_export_jobs.get(t.resource_group, t.filesystem, t.autoexport_job),
        )
        return _autoexport_status(job)

    def _set_admin_status(self, value: str) -> None:
        from azure.mgmt.storagecache.models import AutoExportJobUpdate, AutoExportJobUpdateProperties

        t = self.target
        body = AutoExportJobUpdate(properties=AutoExportJobUpdateProperties(admin_status=value))
        verb = "disable" if value == "Disable" else "enable"

        def patch() -> None:
            poller = self.client.auto_export_jobs.begin_update(
                t.resource_group, t.filesystem, t.autoexport_job, body, polling_interval=self.poll_interval
            )
            poller.result(timeout=self.timeout)

        self._call(f"{verb} auto-export job {t.autoexport_job}", t.autoexport_id, patch)

    def disable_autoexport(self, timeout: float | None = None) -> AutoExportStatus:
        """PATCH adminStatus Disable, then wait until the service reports state Disabled."""
        t = self.target
        limit = self.timeout if timeout is None else timeout
        deadline = time.monotonic() + limit
        self._set_admin_status("Disable")
        while True:
            st = self.autoexport_status()
            if st.state == "Disabled":
                return st
            if st.state in ("DisableFailed", "Failed"):
                raise UnavailableError(
                    f"auto-export job {t.autoexport_job} on {t.filesystem} did not stop: state {st.state}"
                    f"{': ' + st.status_message if st.status_message else ''}; nothing was imported. "
                    f"Retry later, or check the job in the portal (Blob integration) and re-enable it with: {t.enable_command()}"
                )
            if time.monotonic() >= deadline:
                raise UnavailableError(
                    f"auto-export job {t.autoexport_job} on {t.filesystem} still {st.state} after {limit:.0f} s "
                    f"(asked to disable); nothing was imported. Re-run later; to turn it back on: {t.enable_command()}"
                )
            self._sleep(self.poll_interval)

    def enable_autoexport(self) -> AutoExportStatus:
        """PATCH adminStatus Enable (the service resumes exporting on its own schedule)."""
        self._set_admin_status("Enable")
        return self.autoexport_status()

    @contextmanager
    def autoexport_paused(self, timeout: float | None = None) -> Iterator[AutoExportStatus]:
        """Disable auto-export (wait for Disabled), run the block, re-enable ALWAYS.

        Re-enabling happens on success, on any exception and on Ctrl-C; a second Ctrl-C during
        the re-enable is held back until it finishes. Enabled is the platform's steady state, so
        the block ends with auto-export enabled even if it was off before (a killed earlier
        restore must not leave new checkpoints un-archived for good).
        """
        try:
            status = self.disable_autoexport(timeout)
        except BaseException as first:
            # A disable that half-happened (DisableFailed, timeout, Ctrl-C) must not leave export
            # off; one that ARM refused outright (403, 404) changed nothing and needs no undo.
            if self._needs_reenable():
                self._reenable_after(first)
            raise
        failure: BaseException | None = None
        try:
            yield status
        except BaseException as e:
            failure = e
            raise
        finally:
            self._reenable_after(failure)

    def _needs_reenable(self) -> bool:
        try:
            return self.autoexport_status().admin_status != "Enable"
        except UserError:
            return True

    def _reenable_after(self, failure: BaseException | None) -> None:
        t = self.target
        deferred: list[int] = []
        old = None
        in_main = threading.current_thread() is threading.main_thread()
        if in_main:
            old = signal.signal(signal.SIGINT, lambda signum, frame: deferred.append(signum))
        try:
            self._set_admin_status("Enable")
        except BaseException as e:
            why = redact(str(e) if isinstance(e, UserError) else f"{type(e).__name__}: {e}")
            before = ""
            if failure is not None and not isinstance(failure, KeyboardInterrupt):
                before = f" (the operation before it failed too: {failure})"
            raise AutoExportReenableError(
                f"auto-export job {t.autoexport_job} on {t.filesystem} is still DISABLED: re-enabling it failed: {why}{before}. "
                f"New checkpoints are not archived until it is enabled; run: {t.enable_command()}"
            ) from e
        finally:
            if in_main and old is not None:
                signal.signal(signal.SIGINT, old)
        if deferred and failure is None:
            raise KeyboardInterrupt

    # -- import jobs ----------------------------------------------------------------------------

    def running_blob_jobs(self) -> list[str]:
        """Blob jobs that would block another one: import jobs InProgress/Cancelling and a manual
        archive in progress. Auto-export is reported by autoexport_status()."""
        t = self.target
        jobs = self._call(
            f"list import jobs on {t.filesystem}",
            t.filesystem_id,
            lambda: list(self.client.import_jobs.list_by_aml_filesystem(t.resource_group, t.filesystem)),
        )
        out: list[str] = []
        for j in jobs:
            st = getattr(getattr(j, "properties", None), "status", None)
            state = _str(getattr(st, "state", None))
            if state in IMPORT_RUNNING:
                out.append(f"importJobs/{j.name} ({state})")
        for path, prog in self._archive_entries():
            if prog.state in ARCHIVE_RUNNING:
                pct = f", {prog.percent}%" if prog.percent is not None else ""
                out.append(f"archive {path} ({prog.state}{pct})")
        return out

    def _location(self) -> str:
        t = self.target
        fs = self._call(
            f"read file system {t.filesystem}",
            t.filesystem_id,
            lambda: self.client.aml_filesystems.get(t.resource_group, t.filesystem),
        )
        return str(fs.location)

    def run_import(
        self,
        prefixes: list[str],
        conflict_mode: str = "Skip",
        name: str | None = None,
        maximum_errors: int = 0,
        on_progress: Callable[[ImportResult], None] | None = None,
        timeout: float | None = None,
    ) -> ImportResult:
        """Create an import job for `prefixes` (blob paths, each starting with '/') and wait for it.

        Completed returns the result; CompletedPartial, Failed or Canceled raise ImportJobError
        (its `.result` has the counts). Does not touch auto-export: see import_prefixes().
        """
        from azure.mgmt.storagecache.models import ImportJob, ImportJobProperties

        t = self.target
        if not prefixes:
            raise ConfigError("import: no prefixes given; pass at least one blob path such as /checkpoints/model/global_epoch1_step10")
        bad = [p for p in prefixes if not p.startswith("/")]
        if bad:
            raise ConfigError(f"import prefix {bad[0]!r} must start with '/' (a path in the container, e.g. /{bad[0]})")
        if conflict_mode not in ("Fail", "Skip", "OverwriteIfDirty", "OverwriteAlways"):
            raise ConfigError(f"import conflict mode {conflict_mode!r} is not one of Fail, Skip, OverwriteIfDirty, OverwriteAlways")
        name = name or f"tiered-ckpt-{datetime.now(timezone.utc):%Y%m%d%H%M%S}-{uuid.uuid4().hex[:6]}"
        rid = self._import_id(name)
        location = self._location()
        job = ImportJob(
            location=location,
            properties=ImportJobProperties(
                import_prefixes=list(prefixes), conflict_resolution_mode=conflict_mode, maximum_errors=maximum_errors
            ),
        )

        def create() -> Any:
            poller = self.client.import_jobs.begin_create_or_update(
                t.resource_group, t.filesystem, name, job, polling_interval=self.poll_interval
            )
            return poller.result(timeout=self.timeout)

        created = self._call(f"create import job {name}", rid, create)
        result = _import_result(created, name)
        limit = self.timeout if timeout is None else timeout
        deadline = time.monotonic() + limit
        try:
            while result.state not in IMPORT_TERMINAL:
                if on_progress:
                    on_progress(result)
                if time.monotonic() >= deadline:
                    raise UnavailableError(
                        f"import job {name} on {t.filesystem} still {result.state} after {limit:.0f} s "
                        f"({result.blobs_imported} of {result.blobs_walked} blobs walked imported); it was asked to cancel"
                    )
                self._sleep(self.poll_interval)
                got = self._call(
                    f"read import job {name}",
                    rid,
                    lambda: self.client.import_jobs.get(t.resource_group, t.filesystem, name),
                )
                result = _import_result(got, name)
        except BaseException:
            self._cancel_import(name)
            raise
        if on_progress:
            on_progress(result)
        if result.state != IMPORT_OK:
            raise ImportJobError(
                f"import job {name} on {t.filesystem} ended {result.state}: {result.blobs_imported} of "
                f"{result.blobs_walked} blobs imported, {result.errors} errors, {result.conflicts} conflicts"
                f"{' (' + result.message + ')' if result.message else ''}; prefixes {', '.join(prefixes)}. "
                "The checkpoint is not complete on Lustre; the import log is in the file system's logging container",
                result,
            )
        return result

    def _cancel_import(self, name: str, wait: float = 120.0) -> None:
        """Best effort: ask the service to cancel an import we stop waiting for, and wait (bounded)
        until it has stopped, so the next blob job (re-enabling auto-export) is not refused."""
        from azure.mgmt.storagecache.models import ImportJobUpdate, ImportJobUpdateProperties

        t = self.target
        try:
            self.client.import_jobs.begin_update(
                t.resource_group,
                t.filesystem,
                name,
                ImportJobUpdate(properties=ImportJobUpdateProperties(admin_status="Cancel")),
                polling=False,
            )
            deadline = time.monotonic() + min(wait, self.timeout)
            while time.monotonic() < deadline:
                got = self.client.import_jobs.get(t.resource_group, t.filesystem, name)
                if _import_result(got, name).state not in IMPORT_RUNNING:
                    return
                self._sleep(self.poll_interval)
        except Exception:
            pass

    def import_prefixes(
        self,
        prefixes: list[str],
        conflict_mode: str = "Skip",
        name: str | None = None,
        maximum_errors: int = 0,
        on_progress: Callable[[ImportResult], None] | None = None,
    ) -> ImportResult:
        """Disable auto-export, import, re-enable auto-export (always)."""
        with self.autoexport_paused():
            return self.run_import(prefixes, conflict_mode, name, maximum_errors, on_progress)

    # -- manual archive ---------------------------------------------------------------------------

    def start_archive(self, filesystem_path: str = "/") -> None:
        """POST .../archive: export everything under `filesystem_path` that is not yet in Blob.
        Runs as a blob job, so disable auto-export first (one blob job at a time)."""
        from azure.mgmt.storagecache.models import AmlFilesystemArchiveInfo

        t = self.target
        self._call(
            f"start an archive of {filesystem_path} on {t.filesystem}",
            t.filesystem_id,
            lambda: self.client.aml_filesystems.archive(
                t.resource_group, t.filesystem, AmlFilesystemArchiveInfo(filesystem_path=filesystem_path)
            ),
        )

    def cancel_archive(self) -> None:
        t = self.target
        self._call(
            f"cancel the archive on {t.filesystem}",
            t.filesystem_id,
            lambda: self.client.aml_filesystems.cancel_archive(t.resource_group, t.filesystem),
        )

    def _archive_entries(self) -> list[tuple[str, ArchiveProgress]]:
        t = self.target
        fs = self._call(
            f"read file system {t.filesystem}",
            t.filesystem_id,
            lambda: self.client.aml_filesystems.get(t.resource_group, t.filesystem),
        )
        hsm = getattr(getattr(fs, "properties", None), "hsm", None)
        out = []
        for entry in getattr(hsm, "archive_status", None) or []:
            st = entry.status
            err = None
            if st is not None and (st.error_code or st.error_message):
                err = f"{st.error_code or 'error'}: {st.error_message or ''}".strip()
            out.append(
                (
                    _str(entry.filesystem_path),
                    ArchiveProgress(_str(st.state if st else None) or "Idle", st.percent_complete if st else None, err),
                )
            )
        return out

    def archive_status(self, filesystem_path: str | None = None) -> ArchiveProgress:
        """The manual archive's state; for `filesystem_path` if given, else the latest entry.
        No entry at all reads as Idle."""
        entries = self._archive_entries()
        if filesystem_path is not None:
            entries = [e for e in entries if e[0] == filesystem_path]
        if not entries:
            return ArchiveProgress("Idle", None, None)
        return entries[-1][1]

    def wait_archive(
        self,
        filesystem_path: str = "/",
        timeout: float | None = None,
        on_progress: Callable[[ArchiveProgress], None] | None = None,
    ) -> ArchiveProgress:
        """Poll archive_status until it leaves the running states; Completed returns, else raise."""
        t = self.target
        limit = self.timeout if timeout is None else timeout
        deadline = time.monotonic() + limit
        while True:
            prog = self.archive_status(filesystem_path)
            if on_progress:
                on_progress(prog)
            if prog.state == "Completed":
                return prog
            if prog.state in ("Failed", "Canceled"):
                raise UnavailableError(
                    f"archive of {filesystem_path} on {t.filesystem} ended {prog.state}"
                    f"{': ' + prog.errors if prog.errors else ''}; files not exported stay only on Lustre. "
                    "Check the logging container, then re-run"
                )
            if time.monotonic() >= deadline:
                raise UnavailableError(
                    f"archive of {filesystem_path} on {t.filesystem} still {prog.state} "
                    f"({prog.percent if prog.percent is not None else '?'}%) after {limit:.0f} s; re-run to keep waiting"
                )
            self._sleep(self.poll_interval)


def _autoexport_status(job: Any) -> AutoExportStatus:
    p = getattr(job, "properties", None)
    s = getattr(p, "status", None)
    g = (lambda name: getattr(s, name, None)) if s is not None else (lambda name: None)
    return AutoExportStatus(
        admin_status=_str(getattr(p, "admin_status", None)),
        state=_str(g("state")),
        status_message=_str(g("status_message")),
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
        provisioning_state=_str(getattr(p, "provisioning_state", None)),
        prefixes=tuple(getattr(p, "auto_export_prefixes", None) or ()),
    )


def _import_result(job: Any, name: str) -> ImportResult:
    p = getattr(job, "properties", None)
    s = getattr(p, "status", None)
    g = (lambda attr: getattr(s, attr, None)) if s is not None else (lambda attr: None)
    return ImportResult(
        name=_str(getattr(job, "name", None)) or name,
        state=_str(g("state")) or "InProgress",
        blobs_walked=_int(g("total_blobs_walked")),
        blobs_imported=_int(g("total_blobs_imported")),
        errors=_int(g("total_errors")),
        message=_str(g("status_message")),
        conflicts=_int(g("total_conflicts")),
        prefixes=tuple(getattr(p, "import_prefixes", None) or ()),
    )
