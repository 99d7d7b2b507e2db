"""Azure failures of the AMLFS ARM calls, as user errors: one message that names the resource and the fix.

Every exception azure-core raises for a Microsoft.StorageCache call leaves tiered_ckpt.tiers.arm
through `translate`, with credentials removed (an identity or SDK error can quote a token or a
signed URL).
"""
from __future__ import annotations

from azure.core.exceptions import (
    ClientAuthenticationError,
    HttpResponseError,
    ResourceNotFoundError,
    ServiceRequestError,
    ServiceResponseError,
)

from tiered_ckpt.errors import ConfigError, ConflictError, IntegrityError, UnavailableError, UserError
from tiered_ckpt.redact import redact
from tiered_ckpt.tiers.arm_model import AmlfsTarget, ImportResult

# What azure-core raises for a failed call (after its own retries).
AZURE_ERRORS = (ClientAuthenticationError, HttpResponseError, ServiceRequestError, ServiceResponseError)


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




def _arm_message(err: HttpResponseError) -> str:
    code = getattr(getattr(err, "error", None), "code", None)
    msg = getattr(getattr(err, "error", None), "message", None)
    if code or msg:
        return f"{code or 'error'}: {msg or ''}".strip()
    return str(err.message or err).splitlines()[0]


def translate(err: Exception, target: AmlfsTarget, what: str, resource: str) -> UserError:
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

