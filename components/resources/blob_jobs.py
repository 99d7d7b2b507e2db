"""WaitForBlobJobs: a Pulumi dynamic resource that waits until a file system runs no blob-integration job.

Why: AMLFS runs one blob-integration job at a time (import, manual export, auto-export). A new file
system starts an import job for hsm.settings.importPrefix at creation, and that job can still run
after ARM reports the file system created. Creating the AutoExportJob then fails. On the "coming
back" path (compute side on again over an existing archive) that import re-creates every archived
checkpoint as released stubs and can take a long time, so `pulumi up` would fail without this wait.
The AutoExportJob depends on this resource, so `pulumi up` succeeds without manual retries.

It authenticates like the azure-native provider (components/resources/arm_auth.py: stack config, then ARM_*
variables), not with whatever DefaultAzureCredential finds; and ArmCredentialCheck, created before
the file system, proves that credential can read file systems in the resource group, so a CI run
with unusable credentials fails before anything is created instead of after the file system.

The providers are pickled into the Pulumi state by value (pulumi/pulumi#7755), so everything they
use lives on the classes (static methods) and Azure SDK imports happen inside `create`.
"""
from __future__ import annotations

import inspect
import time
from collections.abc import Callable, Iterable
from typing import Any

import pulumi
import pulumi.dynamic

from components.settings import regions
from tiered_ckpt.tiers.arm_model import ARCHIVE_BUSY, IMPORT_BUSY

from . import arm_auth
from .arm_auth import ArmAuth


class ArmClientFactory:
    """What both providers need to reach ARM with the program's credential (arm_auth), on the class
    so that it travels by value with the pickled providers."""

    MODES = (arm_auth.CLIENT_SECRET, arm_auth.CLIENT_CERTIFICATE, arm_auth.OIDC, arm_auth.MSI, arm_auth.DEFAULT)
    SCOPE = arm_auth.ARM_SCOPE

    @classmethod
    def client(cls, props: dict[str, Any]) -> Any:
        from azure.mgmt.storagecache import StorageCacheManagementClient

        auth = props["auth"]
        return StorageCacheManagementClient(cls.credential(auth), props["subscription_id"], base_url=auth["arm_endpoint"],
                                            credential_scopes=[auth["arm_endpoint"] + cls.SCOPE])

    @classmethod
    def credential(cls, auth: dict[str, Any], fetch: Callable[[str, str], str] | None = None) -> Any:
        """The azure-identity credential of an ArmAuth's props; `fetch(url, bearer)` gets a GitHub OIDC token."""
        from azure.identity import (
            CertificateCredential,
            ClientAssertionCredential,
            ClientSecretCredential,
            DefaultAzureCredential,
            ManagedIdentityCredential,
        )

        secret, cert, oidc, msi, _ = cls.MODES
        mode, authority = auth["mode"], auth["authority"]
        tenant, client = str(auth.get("tenantId") or ""), str(auth.get("clientId") or "")
        if mode == secret:
            return ClientSecretCredential(tenant, client, auth["clientSecret"], authority=authority)
        if mode == cert:
            return CertificateCredential(tenant, client, auth["clientCertificatePath"],
                                         password=auth.get("clientCertificatePassword"), authority=authority)
        if mode == oidc:
            return ClientAssertionCredential(tenant, client, cls.assertion(auth, fetch), authority=authority)
        if mode == msi:
            return ManagedIdentityCredential(client_id=client) if client else ManagedIdentityCredential()
        # The provider's default: the Azure CLI login, or whatever DefaultAzureCredential finds.
        return DefaultAzureCredential(authority=authority, managed_identity_client_id=client or None)

    @classmethod
    def assertion(cls, auth: dict[str, Any], fetch: Callable[[str, str], str] | None = None) -> Callable[[], str]:
        """The OIDC token source, asked again for every token (a file is rotated, a GitHub token expires)."""
        get = fetch or cls.github_oidc

        def token() -> str:
            if auth.get("oidcToken"):
                return str(auth["oidcToken"])
            if auth.get("oidcTokenFilePath"):
                with open(auth["oidcTokenFilePath"], encoding="utf-8") as f:
                    return f.read().strip()
            return get(str(auth["oidcRequestUrl"]), str(auth["oidcRequestToken"]))

        return token

    @staticmethod
    def github_oidc(url: str, bearer: str) -> str:
        """A GitHub Actions ID token for Entra ID's audience (docs.github.com, "About security hardening
        with OpenID Connect": ACTIONS_ID_TOKEN_REQUEST_URL with audience api://AzureADTokenExchange)."""
        import json
        import urllib.request

        sep = "&" if "?" in url else "?"
        req = urllib.request.Request(f"{url}{sep}audience=api://AzureADTokenExchange",
                                     headers={"Authorization": f"Bearer {bearer}", "Accept": "application/json"})
        with urllib.request.urlopen(req, timeout=30) as r:  # noqa: S310 - GitHub's token endpoint
            return str(json.load(r)["value"])


def auth_input(auth: ArmAuth) -> pulumi.Output[dict[str, Any]]:
    """The dynamic resources' `auth` input: the whole dict a Pulumi secret when it holds a secret."""
    props = auth.props()
    if any(k in props for k in arm_auth.SECRETS):
        return pulumi.Output.secret(props)
    return pulumi.Output.from_input(props)


def program_auth() -> ArmAuth:
    """The azure-native provider's settings of this stack (config, then environment), resolved."""
    import os

    cfg = pulumi.Config("azure-native")
    return arm_auth.resolve({k: cfg.get(k) for k in arm_auth.ENV}, os.environ)


class ArmCredentialCheckProvider(pulumi.dynamic.ResourceProvider):
    """Lists the resource group's file systems with the program's credential, and the subscription's
    StorageCache SKUs to prove the region offers the AMLFS SKU and zone (components/settings/regions.py): a failure
    stops `pulumi up` before the file system (AmlFilesystem depends on this) with a message naming the fix."""

    # components/settings/regions.py's pure checks, copied onto the class so that they travel with the pickled provider.
    region_problem = staticmethod(regions.region_problem)
    offering_locations = staticmethod(regions.offering_locations)
    provider_entries = staticmethod(regions.provider_entries)
    vm_size_problems = staticmethod(regions.vm_size_problems)
    _get = staticmethod(regions._get)
    _norm = staticmethod(regions._norm)
    _restricted = staticmethod(regions._restricted)
    _is_amlfs = staticmethod(regions._is_amlfs)
    _same_name = staticmethod(regions._same_name)
    _zones = staticmethod(regions._zones)
    _restricted_zones = staticmethod(regions._restricted_zones)
    _capability = staticmethod(regions._capability)
    # REST versions of the two reads the storagecache SDK has no operation for, sent through its own ARM
    # pipeline (credential, retries, endpoint): Microsoft.Compute Skus stable/2021-07-01, Microsoft.Resources 2021-04-01.
    COMPUTE_SKUS_API = "2021-07-01"
    PROVIDERS_API = "2021-04-01"

    @staticmethod
    def arm_get_all(client: Any, url: str) -> list[dict[str, Any]]:
        """GET an ARM list (following nextLink) with the client's pipeline; raises on a non-2xx answer."""
        from azure.core.rest import HttpRequest

        items: list[dict[str, Any]] = []
        next_url: str | None = url
        while next_url:
            resp = client.send_request(HttpRequest("GET", next_url))
            resp.raise_for_status()
            body = resp.json()
            items += list(body.get("value") or [])
            next_url = body.get("nextLink")
        return items

    @staticmethod
    def arm_get(client: Any, url: str) -> dict[str, Any]:
        from azure.core.rest import HttpRequest

        resp = client.send_request(HttpRequest("GET", url))
        resp.raise_for_status()
        return dict(resp.json())

    @staticmethod
    def _first_line(e: Exception) -> str:
        return str(getattr(e, "message", "") or e).splitlines()[0][:300]

    @staticmethod
    def probe_access(client: Any, resource_group: str, describe: str) -> int:
        try:
            return len(list(client.aml_filesystems.list_by_resource_group(resource_group)))
        except Exception as e:  # noqa: BLE001 - any failure here is reported as the credential's
            first = str(getattr(e, "message", "") or e).splitlines()[0][:300]
            raise RuntimeError(
                f"tiered:ArmCredentialCheck: the program's own ARM calls (waiting for AMLFS blob jobs) cannot use "
                f"credential {describe}: {type(e).__name__}: {first}. Nothing was created after this check. Fix the "
                "azure-native provider settings (azure-native:clientId/tenantId/clientSecret or useOidc, or ARM_* "
                "variables, or `az login`) and make sure the identity may read Microsoft.StorageCache/amlFilesystems "
                f"in resource group {resource_group}; then run `pulumi up` again") from None

    @classmethod
    def check_region(cls, client: Any, location: str, sku: str, zone: str | None, subscription_id: str = "") -> None:
        """Raise (before the file system exists) unless the subscription's SKU list offers `sku` in `location`."""
        try:
            entries = [e.as_dict() if hasattr(e, "as_dict") else dict(e) for e in client.skus.list()]
        except Exception as e:  # noqa: BLE001 - reported with the setting it guards
            first = cls._first_line(e)
            raise RuntimeError(
                f"tiered:ArmCredentialCheck: could not list the subscription's StorageCache SKUs to check that {location!r} "
                f"offers {sku!r}: {type(e).__name__}: {first}. Nothing was created after this check. The program's identity "
                "needs Microsoft.StorageCache/skus/read on the subscription (Reader or Contributor has it)") from None
        provider = None
        if not any(cls._is_amlfs(e) for e in entries):
            # No AMLFS entry in the SKU list: fall back to where the provider registers amlFilesystems.
            try:
                provider = cls.arm_get(client, f"/subscriptions/{subscription_id}/providers/Microsoft.StorageCache"
                                               f"?api-version={cls.PROVIDERS_API}")
            except Exception as e:  # noqa: BLE001 - reported with the setting it guards
                raise RuntimeError(
                    f"tiered:ArmCredentialCheck: the StorageCache SKU list names no AMLFS SKU and the provider registration "
                    f"could not be read to check {location!r}: {type(e).__name__}: {cls._first_line(e)}. Nothing was created "
                    "after this check. `az provider register --namespace Microsoft.StorageCache`, then run `pulumi up` again") from None
        problem = cls.region_problem(entries, sku, location, zone, provider)
        if problem:
            raise RuntimeError(f"tiered:ArmCredentialCheck: {problem}. Nothing was created after this check")

    @classmethod
    def check_vm_sizes(cls, client: Any, subscription_id: str, location: str, zone: str | None,
                       vms: list[dict[str, Any]]) -> None:
        """Raise (before the file system exists) with every problem of the VM sizes in `location`/`zone`."""
        if not vms:
            return
        url = (f"/subscriptions/{subscription_id}/providers/Microsoft.Compute/skus?api-version={cls.COMPUTE_SKUS_API}"
               f"&$filter=location eq '{location}'")
        try:
            entries = cls.arm_get_all(client, url)
        except Exception as e:  # noqa: BLE001 - reported with the settings it guards
            raise RuntimeError(
                f"tiered:ArmCredentialCheck: could not list the subscription's compute SKUs in {location!r} to check "
                f"{', '.join(str(v['size']) for v in vms)}: {type(e).__name__}: {cls._first_line(e)}. Nothing was created after "
                "this check. The program's identity needs Microsoft.Compute/skus/read on the subscription (Reader or Contributor has it)") from None
        problems = cls.vm_size_problems(entries, location, zone, vms)
        if problems:
            raise RuntimeError("tiered:ArmCredentialCheck: " + "\n".join(problems) + "\nNothing was created after this check")

    def create(self, props: dict[str, Any]) -> pulumi.dynamic.CreateResult:
        client = ArmClientFactory.client(props)
        n = self.probe_access(client, props["resource_group"], props["describe"])
        if props.get("location") and props.get("sku"):
            self.check_region(client, props["location"], props["sku"], props.get("zone"), props["subscription_id"])
        if props.get("location") and props.get("vms"):
            self.check_vm_sizes(client, props["subscription_id"], props["location"], props.get("zone"), list(props["vms"]))
        return pulumi.dynamic.CreateResult(id_=f"{props['resource_group']}/arm-credential-ok", outs={**props, "filesystems": n})

    def diff(self, _id: str, olds: dict[str, Any], news: dict[str, Any]) -> pulumi.dynamic.DiffResult:
        changed = [k for k in ("subscription_id", "resource_group", "describe", "location", "sku", "zone", "vms")
                   if olds.get(k) != news.get(k)]
        return pulumi.dynamic.DiffResult(changes=bool(changed), replaces=changed, delete_before_replace=True)

    def delete(self, _id: str, _props: dict[str, Any]) -> None:
        return None


class ArmCredentialCheck(pulumi.dynamic.Resource, module="tiered", name="ArmCredentialCheck"):
    """Completes once the program's credential has read the resource group's file systems, the
    subscription's SKU list offers the AMLFS SKU in the stack's location and zone, and the compute SKU list
    offers every VM size there (zone, restrictions, Trusted Launch)."""

    def __init__(self, name: str, *, auth: ArmAuth, subscription_id: pulumi.Input[str], resource_group: pulumi.Input[str],
                 location: str | None = None, sku: str | None = None, zone: str | None = None,
                 vms: list[dict[str, Any]] | None = None, opts: pulumi.ResourceOptions | None = None) -> None:
        # vms: [{"key": setting, "size": VM size, "trusted_launch": bool}] checked against Microsoft.Compute/skus.
        super().__init__(
            ArmCredentialCheckProvider(), name,
            {"auth": auth_input(auth), "describe": auth.describe(), "subscription_id": subscription_id,
             "resource_group": resource_group, "location": location, "sku": sku, "zone": zone, "vms": vms or [],
             "filesystems": None},
            opts)


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
        # Runs in the dynamic provider host with the credential the program resolved (arm_auth).
        client = ArmClientFactory.client(props)
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

    def __init__(self, name: str, *, auth: ArmAuth, subscription_id: pulumi.Input[str], resource_group: pulumi.Input[str],
                 filesystem: pulumi.Input[str], filesystem_id: pulumi.Input[str], timeout_s: int, poll_s: int = 30,
                 opts: pulumi.ResourceOptions | None = None) -> None:
        super().__init__(
            WaitForBlobJobsProvider(), name,
            {"auth": auth_input(auth), "subscription_id": subscription_id, "resource_group": resource_group, "filesystem": filesystem,
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


for _cls in (WaitForBlobJobsProvider, ArmCredentialCheckProvider, ArmClientFactory):
    _pickle_by_value(_cls)
