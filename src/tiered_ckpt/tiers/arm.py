"""Azure Resource Manager calls for the AMLFS tier: auto-export, import jobs, manual archive.

Built only on azure-mgmt-storagecache (its pipeline does retries with backoff, LRO polling and
ARM error parsing) and azure-identity (the node's managed identity, or whatever
DefaultAzureCredential finds on a workstation). Every Azure failure leaves this module as a
UserError subclass with one message that names the resource and the fix (tiers/arm_errors.py);
the state names and the plain records it returns are in tiers/arm_model.py.

AMLFS runs only one blob-integration job (import, manual archive, auto-export) at a time, so an
import first disables auto-export, waits until the service reports Disabled, imports, and
re-enables auto-export in a `finally` (also on Ctrl-C): `AmlfsJobs.import_prefixes`. The three
kinds of job share that one slot, which is why they are one class here: the client and its
credentials, auto-export, import jobs and the manual archive, in that order, in marked sections.
"""
from __future__ import annotations

import signal
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import datetime, timezone
from typing import TYPE_CHECKING, Any, TypeVar

from tiered_ckpt.errors import ConfigError, UnavailableError, UserError
from tiered_ckpt.redact import redact
from tiered_ckpt.tiers.arm_errors import (
    AZURE_ERRORS,
    ArmNotFoundError,
    ArmPermissionError,
    AutoExportReenableError,
    ImportJobError,
    translate,
)
from tiered_ckpt.tiers.arm_model import (
    ADMIN_DISABLE,
    ADMIN_ENABLE,
    API_VERSION,
    ARCHIVE_BUSY,
    ARCHIVE_COMPLETED,
    ARCHIVE_ENDED_BADLY,
    ARCHIVE_IDLE,
    AUTOEXPORT_DISABLED,
    AUTOEXPORT_STOP_FAILED,
    IMPORT_BUSY,
    IMPORT_COMPLETED,
    IMPORT_TERMINAL,
    PROVISIONING_BUSY,
    PROVISIONING_FAILED,
    AmlfsTarget,
    ArchiveProgress,
    AutoExportStatus,
    ImportResult,
    archive_entries_of,
    autoexport_status_of,
    import_result_of,
    wire,
)

if TYPE_CHECKING:
    from tiered_ckpt.config import NodeConfig

# The public names of the AMLFS tier: importers use tiered_ckpt.tiers.arm only.
__all__ = [
    "API_VERSION", "AmlfsJobs", "AmlfsTarget", "ArchiveProgress", "ArmNotFoundError", "ArmPermissionError",
    "AutoExportReenableError", "AutoExportStatus", "ImportJobError", "ImportResult", "default_credential", "make_client",
]

T = TypeVar("T")

# Defaults a test (or a future setting) may change for every AmlfsJobs built without explicit values:
# how often to poll job state, how long to wait, and azure-core client options (retry policy).
DEFAULT_POLL_INTERVAL = 10.0
DEFAULT_TIMEOUT = 3600.0
CLIENT_DEFAULTS: dict[str, Any] = {"retry_total": 5, "retry_backoff_factor": 0.8, "retry_backoff_max": 60}

# ---------------------------------------------------------------------------------------------
# The client and its credentials


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


# ---------------------------------------------------------------------------------------------
# The jobs (one blob-integration job at a time on a file system)


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
        except AZURE_ERRORS as e:
            raise translate(e, self.target, what, resource) from None

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
        return autoexport_status_of(job)

    def _set_admin_status(self, value: str) -> None:
        """PATCH adminStatus without polling the long-running operation.

        ARM answers 202 with an Azure-AsyncOperation URL under
        /subscriptions/{sub}/providers/Microsoft.StorageCache/locations/{loc}/ascOperations/{id}
        (REST spec example autoExportJobs_Update.json). A role assigned at the file system (the
        node's) cannot read that subscription-scoped URL, so the SDK's poller would fail with 403
        after the change was accepted. The job's own GET (allowed at the file system's scope)
        reports the outcome instead: `_await_update` reads its provisioningState.
        """
        from azure.mgmt.storagecache.models import AutoExportJobUpdate, AutoExportJobUpdateProperties

        t = self.target
        body = AutoExportJobUpdate(properties=AutoExportJobUpdateProperties(admin_status=value))
        verb = "disable" if value == ADMIN_DISABLE else "enable"
        self._call(
            f"{verb} auto-export job {t.autoexport_job}",
            t.autoexport_id,
            lambda: self.client.auto_export_jobs.begin_update(
                t.resource_group, t.filesystem, t.autoexport_job, body, polling=False
            ),
        )
        self._await_update(verb, value)

    def _await_update(self, verb: str, value: str) -> AutoExportStatus:
        """GET the job until its update has ended (provisioningState leaves Updating/Creating)."""
        t = self.target
        deadline = time.monotonic() + self.timeout
        while True:
            st = self.autoexport_status()
            if st.provisioning_state in PROVISIONING_FAILED:
                raise UnavailableError(
                    f"auto-export job {t.autoexport_job} on {t.filesystem}: the request to {verb} it ended "
                    f"{st.provisioning_state} (admin status {st.admin_status or 'unknown'})"
                    f"{': ' + st.status_message if st.status_message else ''}"
                )
            if st.provisioning_state not in PROVISIONING_BUSY and st.admin_status == value:
                return st
            if time.monotonic() >= deadline:
                raise UnavailableError(
                    f"auto-export job {t.autoexport_job} on {t.filesystem}: asked to {verb} it, still provisioning "
                    f"state {st.provisioning_state or 'unknown'} with admin status {st.admin_status or 'unknown'} "
                    f"after {self.timeout:.0f} s"
                )
            self._sleep(self.poll_interval)

    def disable_autoexport(self, timeout: float | None = None) -> AutoExportStatus:
        """PATCH adminStatus Disable, then wait until the service reports state Disabled."""
        t = self.target
        limit = self.timeout if timeout is None else timeout
        deadline = time.monotonic() + limit
        self._set_admin_status(ADMIN_DISABLE)
        while True:
            st = self.autoexport_status()
            if st.state == AUTOEXPORT_DISABLED:
                return st
            if st.state in AUTOEXPORT_STOP_FAILED:
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
        self._set_admin_status(ADMIN_ENABLE)
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
            return self.autoexport_status().admin_status != ADMIN_ENABLE
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
            self._set_admin_status(ADMIN_ENABLE)
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
            state = wire(getattr(st, "state", None))
            if state in IMPORT_BUSY:
                out.append(f"importJobs/{j.name} ({state})")
        for path, prog in self._archive_entries():
            if prog.state in ARCHIVE_BUSY:
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

        # No LRO polling (see _set_admin_status): the PUT's 201 body is the job, and its own GET
        # (importJobs/read at the file system's scope) follows it to a terminal state.
        created = self._call(
            f"create import job {name}",
            rid,
            lambda: self.client.import_jobs.begin_create_or_update(
                t.resource_group, t.filesystem, name, job, polling=False
            ).result(),
        )
        result = import_result_of(created, name)
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
                result = import_result_of(got, name)
        except BaseException:
            self._cancel_import(name)
            raise
        if on_progress:
            on_progress(result)
        if result.state != IMPORT_COMPLETED:
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
                if import_result_of(got, name).state not in IMPORT_BUSY:
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
        return archive_entries_of(fs)

    def archive_status(self, filesystem_path: str | None = None) -> ArchiveProgress:
        """The manual archive's state; for `filesystem_path` if given, else the latest entry.
        No entry at all reads as Idle."""
        entries = self._archive_entries()
        if filesystem_path is not None:
            entries = [e for e in entries if e[0] == filesystem_path]
        if not entries:
            return ArchiveProgress(ARCHIVE_IDLE, None, None)
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
            if prog.state == ARCHIVE_COMPLETED:
                return prog
            if prog.state in ARCHIVE_ENDED_BADLY:
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
