"""How the program's own ARM calls authenticate: the azure-native provider's settings, resolved once.

The dynamic resources of this program (WaitForBlobJobs, ArmCredentialCheck) call ARM themselves,
from the dynamic provider host, which does not see the azure-native provider's credentials. A
bare DefaultAzureCredential there works after `az login` but not in CI with OIDC or a service
principal configured as stack config (`azure-native:clientId`, ...), and it fails only after the
file system exists. So the program resolves the same settings the provider reads, stack config
first, then its ARM_* environment variables (https://www.pulumi.com/registry/packages/azure-native/
installation-configuration/), into one `ArmAuth`, refuses what it cannot honour before any
resource is created, and hands it (secrets as Pulumi secrets) to the dynamic providers, which
build the matching azure-identity credential (blob_jobs.ArmClientFactory).

Pure: no Pulumi, no network. `resolve` is tested with plain mappings.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from components.settings.schema import SettingsError

CLIENT_SECRET, CLIENT_CERTIFICATE, OIDC, MSI, DEFAULT = "client-secret", "client-certificate", "oidc", "msi", "default"

# azure-native `environment` -> (Entra ID authority host, ARM endpoint)
# (https://learn.microsoft.com/azure/azure-government/compare-azure-government-global-azure,
#  https://learn.microsoft.com/azure/china/resources-developer-guide).
CLOUDS: dict[str, tuple[str, str]] = {
    "public": ("login.microsoftonline.com", "https://management.azure.com"),
    "usgovernment": ("login.microsoftonline.us", "https://management.usgovcloudapi.net"),
    "china": ("login.chinacloudapi.cn", "https://management.chinacloudapi.cn"),
}

# Stack config key (azure-native:<key>) -> the environment variable the provider also reads.
ENV = {
    "clientId": "ARM_CLIENT_ID", "tenantId": "ARM_TENANT_ID", "clientSecret": "ARM_CLIENT_SECRET",
    "clientCertificatePath": "ARM_CLIENT_CERTIFICATE_PATH", "clientCertificatePassword": "ARM_CLIENT_CERTIFICATE_PASSWORD",
    "useOidc": "ARM_USE_OIDC", "oidcToken": "ARM_OIDC_TOKEN", "oidcTokenFilePath": "ARM_OIDC_TOKEN_FILE_PATH",
    "oidcRequestToken": "ARM_OIDC_REQUEST_TOKEN", "oidcRequestUrl": "ARM_OIDC_REQUEST_URL",
    "useMsi": "ARM_USE_MSI", "msiEndpoint": "ARM_MSI_ENDPOINT", "environment": "ARM_ENVIRONMENT",
    "metadataHost": "ARM_METADATA_HOSTNAME",
}
# GitHub Actions' own names for the OIDC request (the provider falls back to them).
GITHUB_OIDC = {"oidcRequestToken": "ACTIONS_ID_TOKEN_REQUEST_TOKEN", "oidcRequestUrl": "ACTIONS_ID_TOKEN_REQUEST_URL"}
SECRETS = ("clientSecret", "clientCertificatePassword", "oidcToken", "oidcRequestToken")
ARM_SCOPE = "/.default"


@dataclass(frozen=True)
class ArmAuth:
    """The credential the program's own ARM calls use; `values` holds what that mode needs."""

    mode: str
    authority: str
    arm_endpoint: str
    values: tuple[tuple[str, str], ...] = ()

    def get(self, key: str) -> str | None:
        return dict(self.values).get(key)

    def describe(self) -> str:
        """For messages: the mode and the non-secret identifiers, never a secret."""
        ids = [f"{k}={v}" for k, v in self.values if k in ("clientId", "tenantId", "clientCertificatePath", "oidcTokenFilePath")]
        return f"{self.mode}" + (f" ({', '.join(ids)})" if ids else "")

    def props(self) -> dict[str, Any]:
        """Plain form for a dynamic resource's inputs (the caller marks SECRETS as secret)."""
        return {"mode": self.mode, "authority": self.authority, "arm_endpoint": self.arm_endpoint, **dict(self.values)}


def _truthy(v: str | None) -> bool:
    return str(v or "").strip().lower() in ("1", "true", "yes")


def resolve(config: Mapping[str, str | None], env: Mapping[str, str]) -> ArmAuth:
    """The azure-native provider's authentication settings as one ArmAuth; SettingsError lists every problem."""
    def get(key: str) -> str | None:
        v = config.get(key)
        if v in (None, ""):
            v = env.get(ENV[key]) or (env.get(GITHUB_OIDC[key]) if key in GITHUB_OIDC else None)
        return v or None

    problems: list[str] = []
    cloud = (get("environment") or "public").lower()
    if cloud not in CLOUDS:
        problems.append(f"azure-native:environment {cloud!r} is not one of {', '.join(CLOUDS)}")
    if get("metadataHost"):
        problems.append("azure-native:metadataHost (ARM_METADATA_HOSTNAME) is set: this program's own ARM calls support only "
                        "the public, usgovernment and china clouds; unset it or use azure-native:environment")
    authority, endpoint = CLOUDS.get(cloud, CLOUDS["public"])

    def need(mode: str, *keys: str) -> None:
        missing = [k for k in keys if not get(k)]
        if missing:
            problems.append(f"{mode} authentication needs " + " and ".join(f"azure-native:{k} ({ENV[k]})" for k in missing))

    values: dict[str, str] = {}
    if _truthy(get("useOidc")):
        mode = OIDC
        need(mode, "clientId", "tenantId")
        sources = [k for k in ("oidcToken", "oidcTokenFilePath") if get(k)]
        if get("oidcRequestToken") and get("oidcRequestUrl"):
            sources.append("oidcRequestToken")
        if not sources:
            problems.append("useOidc is set but no token source: set azure-native:oidcToken, azure-native:oidcTokenFilePath, "
                            "or azure-native:oidcRequestToken with oidcRequestUrl (GitHub Actions sets "
                            "ACTIONS_ID_TOKEN_REQUEST_TOKEN/URL when the job has `permissions: id-token: write`)")
        keys = ["clientId", "tenantId", "oidcToken", "oidcTokenFilePath", "oidcRequestToken", "oidcRequestUrl"]
    elif get("clientCertificatePath"):
        mode = CLIENT_CERTIFICATE
        need(mode, "clientId", "tenantId")
        keys = ["clientId", "tenantId", "clientCertificatePath", "clientCertificatePassword"]
    elif get("clientSecret"):
        mode = CLIENT_SECRET
        need(mode, "clientId", "tenantId")
        keys = ["clientId", "tenantId", "clientSecret"]
    elif _truthy(get("useMsi")):
        mode = MSI
        keys = ["clientId", "msiEndpoint"]
    else:
        mode = DEFAULT      # az login, or what DefaultAzureCredential finds (the provider's CLI default)
        keys = ["clientId", "tenantId"]
    for k in keys:
        if get(k):
            values[k] = str(get(k))
    if problems:
        raise SettingsError("\n".join("ARM authentication of this program's own calls (WaitForBlobJobs): " + p for p in problems))
    return ArmAuth(mode, authority, endpoint, tuple(sorted(values.items())))
