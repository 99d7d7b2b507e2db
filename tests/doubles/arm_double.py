"""A local HTTPS stand-in for the Microsoft.StorageCache endpoints of Azure Resource Manager.

Only ARM cannot run here, so this serves the few operations the toolkit uses, shaped like the
REST spec (Azure/azure-rest-api-specs, specification/storagecache/resource-manager/
Microsoft.StorageCache/StorageCache/examples/), api-version 2026-08-01, which is what the real
azure-mgmt-storagecache 4.1.0 client sends. Examples followed, response by response:

* GET  amlFilesystems/{fs}                     -- 2026-08-01/amlFilesystems_Get.json (hsm.archiveStatus[])
* POST amlFilesystems/{fs}/archive             -- 2026-01-01/amlFilesystems_Archive.json (200, empty; body filesystemPath)
* POST amlFilesystems/{fs}/cancelArchive       -- 2026-01-01/amlFilesystems_CancelArchive.json (200, empty)
* GET  .../autoExportJobs/{job}                -- 2026-01-01/autoExportJobs_Get.json (status counters, state)
* PATCH .../autoExportJobs/{job}               -- 2026-08-01/autoExportJobs_Update.json (202 + Azure-AsyncOperation + Location)
* PUT  .../importJobs/{job}                    -- 2026-01-01/importJobs_CreateOrUpdate.json (201 + Azure-AsyncOperation)
* GET  .../importJobs/{job}                    -- 2026-08-01/importJobs_Get.json
* PATCH .../importJobs/{job}                   -- 2026-08-01/importJob_Update.json (adminStatus Cancel; 202 + headers)
* GET  .../importJobs                          -- 2026-08-01/importJobs_ListByAmlFilesystem.json ({"value": [...]})
* DELETE .../importJobs/{job}                  -- 2026-08-01/importJobs_Delete.json (202 + headers / 204)
* GET  .../locations/{loc}/ascOperations/{id}  -- 2026-08-01/AscOperations_Get.json (the async-operation monitor)
* GET  /subscriptions/{sub}/providers/Microsoft.StorageCache/skus -- Skus_List.json (the preflight's region check)

Two reads outside Microsoft.StorageCache, for the program's preflight (components/settings/regions.py), each at
its own api-version:

* GET  /subscriptions/{sub}/providers/Microsoft.Compute/skus?$filter=location eq '<loc>'
  -- Microsoft.Compute/Skus/stable/2021-07-01/examples/skus/ListAvailableResourceSkusForARegion.json
  (resourceType, name, tier, size, family, locations, locationInfo[].zones/zoneDetails, capabilities,
  restrictions; "nextLink" pages), api-version 2021-07-01; the filter is honoured (one location only)
* GET  /subscriptions/{sub}/providers/Microsoft.StorageCache -- Microsoft.Resources 2021-04-01 Providers_Get
  (resources.json: Provider.resourceTypes[].locations, .zoneMappings[] {location, zones}), api-version 2021-04-01

Every request is authorized as ARM does (role actions/notActions at a scope, per bearer token;
see Grant): the node identity gets the roles the Pulumi program assigns (tests/doubles/
program_roles.py), an operator token Contributor on the subscription, anyone else nothing.

Errors use the ARM error body {"error": {"code", "message"}}; 403 and 404 carry ARM's
AuthorizationFailed / ResourceNotFound wording. Two behaviours come from the service docs, not the
examples, and their error codes are this double's choice: only one blob job runs at a time (a new
import or archive while auto-export is not Disabled, or while another import or archive runs, is
refused with 409 "Conflict"); and state changes take time (auto-export goes Disabling -> Disabled
over a number of polls, an import goes InProgress -> terminal over a number of polls).

TLS: azure-core's bearer-token policy refuses plain HTTP, so the server speaks HTTPS with a
throwaway self-signed certificate made by `make_tls_cert` (the `cryptography` package); clients
trust it with connection_verify=<ca_cert> or REQUESTS_CA_BUNDLE.
"""
from __future__ import annotations

import datetime as dt
import json
import re
import ssl
import threading
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

API_VERSION = "2026-08-01"
SUBSCRIPTION = "00000000-0000-0000-0000-000000000000"
RESOURCE_GROUP = "scgroup"
FILESYSTEM = "fs1"
AUTOEXPORT_JOB = "job1"
LOCATION = "eastus"


def _now() -> str:
    return dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%f")[:-3] + "Z"


def make_tls_cert(directory: Path) -> tuple[Path, Path]:
    """A self-signed certificate for localhost/127.0.0.1: (cert.pem, key.pem)."""
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "localhost")])
    now = dt.datetime.now(dt.timezone.utc)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + dt.timedelta(days=2))
        .add_extension(
            x509.SubjectAlternativeName([x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
            critical=False,
        )
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    directory.mkdir(parents=True, exist_ok=True)
    cert_path, key_path = directory / "arm-double-cert.pem", directory / "arm-double-key.pem"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    return cert_path, key_path


class StaticTokenCredential:
    """A TokenCredential that hands out a fixed token (AAD is not reachable here)."""

    def __init__(self, token: str = "fake-arm-token") -> None:
        self.token = token
        self.scopes: list[tuple[str, ...]] = []

    def get_token(self, *scopes: str, **kwargs: Any) -> Any:
        from azure.core.credentials import AccessToken

        self.scopes.append(scopes)
        return AccessToken(self.token, int(dt.datetime.now().timestamp()) + 3600)


@dataclass(frozen=True)
class Grant:
    """One role assignment as ARM evaluates it: the role's actions/notActions at a scope.

    ARM allows a management request when some assignment of the caller has a scope that is the
    request's resource or one of its parents, and an action pattern (`*` wildcards, case
    insensitive) that matches the operation while no notActions pattern does
    (https://learn.microsoft.com/azure/role-based-access-control/role-definitions#actions,
    .../role-definitions#notactions, .../scope-overview).
    """

    actions: tuple[str, ...]
    scope: str
    not_actions: tuple[str, ...] = ()

    def allows(self, action: str, resource: str) -> bool:
        import fnmatch

        scope, res, act = self.scope.rstrip("/").lower(), resource.rstrip("/").lower(), action.lower()
        if not (res == scope or res.startswith(scope + "/") or scope == ""):
            return False
        if not any(fnmatch.fnmatchcase(act, a.lower()) for a in self.actions):
            return False
        return not any(fnmatch.fnmatchcase(act, a.lower()) for a in self.not_actions)


# Azure's built-in Contributor role (what an operator usually holds on the subscription): every
# management action except granting access (https://learn.microsoft.com/azure/role-based-access-control/
# built-in-roles/privileged#contributor).
CONTRIBUTOR_ACTIONS = ("*",)
CONTRIBUTOR_NOT_ACTIONS = (
    "Microsoft.Authorization/*/Delete", "Microsoft.Authorization/*/Write", "Microsoft.Authorization/elevateAccess/Action",
    "Microsoft.Blueprint/blueprintAssignments/write", "Microsoft.Blueprint/blueprintAssignments/delete",
    "Microsoft.Compute/galleries/share/action", "Microsoft.Purview/consents/write", "Microsoft.Purview/consents/delete",
)
NODE_TOKEN = "fake-arm-token"          # StaticTokenCredential's default: the node's managed identity
OPERATOR_TOKEN = "operator-arm-token"  # a person with Contributor on the subscription


@dataclass
class Request:
    method: str
    path: str
    kind: str        # e.g. "autoexport.patch", "import.put", "fs.get", "archive.post", "asyncop.get"
    body: Any
    status: int


@dataclass
class Scenario:
    """What the double does next. Tests set fields before (or while) the code under test runs."""

    # Auto-export job: REST-shaped status (camelCase, like autoExportJobs_Get.json); the double
    # only drives "state" (and properties.adminStatus) itself.
    autoexport_admin: str = "Enable"
    autoexport: dict[str, Any] = field(
        default_factory=lambda: {
            "currentIterationFilesDiscovered": 10,
            "currentIterationFilesExported": 10,
            "currentIterationFilesFailed": 0,
            "currentIterationMiBDiscovered": 4000,
            "currentIterationMiBExported": 4000,
            "exportIterationCount": 100,
            "lastStartedTimeUTC": "2026-11-29T17:25:43.511Z",
            "lastSuccessfulIterationCompletionTimeUTC": "2026-11-29T17:28:43.511Z",
            "state": "InProgress",
            "statusMessage": "Auto Export is in progress",
            "totalFilesExported": 1000000,
            "totalFilesFailed": 0,
            "totalMiBExported": 10000,
        }
    )
    autoexport_prefixes: list[str] = field(default_factory=lambda: ["/"])
    disable_polls: int = 2                # GETs that still read Disabling after a Disable
    # A running job keeps iterating: each GET while InProgress sees one more completed iteration
    # (exportIterationCount + 1). Off by default so tests can freeze the counters.
    iterate_on_get: bool = False
    disable_result: str = "Disabled"      # or "DisableFailed"
    enable_fails: str | None = None       # None | "lro" (async op ends Failed) | "http" (PATCH answers enable_status)
    enable_status: int = 400
    # Import jobs.
    import_polls: int = 2                 # GETs that read InProgress before the job ends
    import_result: str = "Completed"      # Completed | CompletedPartial | Failed | Canceled
    import_blobs: int = 10                # totalBlobsWalked at the end
    import_errors: int = 0                # totalErrors at the end (imported = blobs - errors)
    import_hook: Callable[[list[str], str], tuple[int, int, int] | None] | None = None
    #   called when a job ends Completed/CompletedPartial with (prefixes, conflictResolutionMode);
    #   may return (walked, imported, errors) to report instead of the numbers above
    one_blob_job: bool = True             # refuse a second blob job with 409
    # Manual archive.
    archive_polls: int = 2                # GETs of the file system before the archive ends
    archive_result: str = "Completed"     # Completed | Failed
    archive_hook: Callable[[str], None] | None = None   # called with filesystemPath when it ends Completed
    # Async operations (the LRO monitor): polls that read InProgress before Succeeded/Failed.
    lro_polls: int = 1
    # Faults: statuses to answer for the next requests of a kind (then normal service).
    faults: dict[str, list[int]] = field(default_factory=dict)
    deny: set[str] = field(default_factory=set)   # kinds answered 403 AuthorizationFailed
    # The subscription's StorageCache SKU list (Skus_List.json shape: resourceType, name, locations,
    # locationInfo with zones, restrictions). None = the four AMLFS SKUs in the double's location, zones 1-3.
    skus: list[dict[str, Any]] | None = None
    # The subscription's compute SKU list (ResourceSkus_List shape). None = the ND and login sizes the program
    # knows, in the double's location, zones 1-3, with TrustedLaunchDisabled=True on the ND A100 v4 sizes
    # (azure-compute-docs trusted-launch.md: NDasrA100_v4 and NDm_A100_v4 "Currently not supported").
    compute_skus: list[dict[str, Any]] | None = None
    compute_skus_page: int = 0            # entries per page (then "nextLink"); 0 = one page
    # The StorageCache provider registration (Providers_Get shape). None = amlFilesystems in the double's location.
    provider: dict[str, Any] | None = None

    def fail_next(self, kind: str, *statuses: int) -> None:
        self.faults.setdefault(kind, []).extend(statuses)


_ROOT = r"/subscriptions/(?P<sub>[^/]+)/resourcegroups/(?P<rg>[^/]+)/providers/microsoft\.storagecache/amlfilesystems/(?P<fs>[^/]+)"
_ROUTES: list[tuple[str, re.Pattern[str]]] = [
    ("asyncop", re.compile(r"^/subscriptions/(?P<sub>[^/]+)/providers/microsoft\.storagecache/locations/(?P<loc>[^/]+)/ascoperations/(?P<op>[^/]+)$", re.I)),
    ("autoexport", re.compile(_ROOT + r"/autoexportjobs/(?P<job>[^/]+)$", re.I)),
    ("autoexports", re.compile(_ROOT + r"/autoexportjobs$", re.I)),
    ("import", re.compile(_ROOT + r"/importjobs/(?P<job>[^/]+)$", re.I)),
    ("imports", re.compile(_ROOT + r"/importjobs$", re.I)),
    ("archive", re.compile(_ROOT + r"/archive$", re.I)),
    ("cancelArchive", re.compile(_ROOT + r"/cancelarchive$", re.I)),
    ("fs", re.compile(_ROOT + r"$", re.I)),
    ("skus", re.compile(r"^/subscriptions/(?P<sub>[^/]+)/providers/microsoft\.storagecache/skus$", re.I)),
    ("computeSkus", re.compile(r"^/subscriptions/(?P<sub>[^/]+)/providers/microsoft\.compute/skus$", re.I)),
    ("provider", re.compile(r"^/subscriptions/(?P<sub>[^/]+)/providers/microsoft\.storagecache$", re.I)),
    ("fss", re.compile(r"^/subscriptions/(?P<sub>[^/]+)/resourcegroups/(?P<rg>[^/]+)/providers/microsoft\.storagecache/amlfilesystems$", re.I)),
]


class ArmDouble:
    """One AMLFS file system with one auto-export job, served over HTTPS on 127.0.0.1."""

    def __init__(
        self,
        cert: Path,
        key: Path,
        *,
        subscription_id: str = SUBSCRIPTION,
        resource_group: str = RESOURCE_GROUP,
        filesystem: str = FILESYSTEM,
        autoexport_job: str = AUTOEXPORT_JOB,
        location: str = LOCATION,
    ) -> None:
        self.ca_cert = cert
        self._key = key
        self.subscription_id = subscription_id
        self.resource_group = resource_group
        self.filesystem = filesystem
        self.autoexport_job = autoexport_job
        self.location = location
        self.scenario = Scenario()
        self.requests: list[Request] = []
        self.lock = threading.RLock()
        self._imports: dict[str, dict[str, Any]] = {}   # name -> {"body": ..., "polls_left": n, "prefixes": ...}
        self._ops: dict[str, dict[str, Any]] = {}
        self._disabling_left = 0
        self._archive: dict[str, Any] | None = None
        self._server: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None
        self._ae_update: dict[str, Any] | None = None   # an auto-export PATCH still being applied
        # RBAC: bearer token -> its role assignments. Every request is checked (no token is trusted).
        self.grants: dict[str, list[Grant]] = {}
        self.authorized: list[tuple[str, str]] = []     # (token, action) of every request allowed

    # -- RBAC ------------------------------------------------------------------------------------

    def grant(self, token: str, actions: Any, scope: str, not_actions: Any = ()) -> None:
        """Give the caller presenting `token` a role with `actions` at `scope` (an ARM resource id)."""
        with self.lock:
            self.grants.setdefault(token, []).append(Grant(tuple(actions), scope, tuple(not_actions)))

    def grant_operator(self, token: str = OPERATOR_TOKEN) -> None:
        """Contributor on the whole subscription."""
        self.grant(token, CONTRIBUTOR_ACTIONS, f"/subscriptions/{self.subscription_id}", CONTRIBUTOR_NOT_ACTIONS)

    @property
    def filesystem_id(self) -> str:
        return self._fs_id()

    def _authorize(self, token: str, kind: str, path: str) -> tuple[int, dict[str, str], Any] | None:
        action = _action(kind)
        if any(g.allows(action, path) for g in self.grants.get(token, [])):
            self.authorized.append((token, action))
            return None
        return 403, {}, _err(
            "AuthorizationFailed",
            f"The client '{_principal(token)}' with object id '{_principal(token)}' does not have authorization to "
            f"perform action '{action}' over scope '{path}' or the scope is invalid. If access was recently granted, "
            "please refresh your credentials.",
        )

    # -- lifecycle -------------------------------------------------------------------------------

    def start(self) -> ArmDouble:
        double = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"
            disable_nagle_algorithm = True   # headers and body go out as separate writes

            def log_message(self, format: str, *args: Any) -> None:
                pass

            def _handle(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                raw = self.rfile.read(length) if length else b""
                status, headers, body = double.handle(self.command, self.path, dict(self.headers), raw)
                data = b"" if body is None else json.dumps(body).encode()
                self.send_response(status)
                for k, v in headers.items():
                    self.send_header(k, v)
                if body is not None:
                    self.send_header("Content-Type", "application/json; charset=utf-8")
                self.send_header("Content-Length", str(len(data)))
                self.send_header("x-ms-request-id", str(uuid.uuid4()))
                self.end_headers()
                self.wfile.write(data)

            do_GET = do_PUT = do_PATCH = do_POST = do_DELETE = _handle

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.load_cert_chain(str(self.ca_cert), str(self._key))
        self._server.socket = ctx.wrap_socket(self._server.socket, server_side=True)
        self._thread = threading.Thread(target=self._server.serve_forever, args=(0.05,), name="arm-double", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    @property
    def endpoint(self) -> str:
        assert self._server is not None, "ArmDouble not started"
        return f"https://127.0.0.1:{self._server.server_address[1]}"

    def target(self, **overrides: Any) -> Any:
        """An AmlfsTarget pointing at this double (override names to aim at missing resources)."""
        from tiered_ckpt.tiers.arm import AmlfsTarget

        values: dict[str, Any] = {
            "subscription_id": self.subscription_id,
            "resource_group": self.resource_group,
            "filesystem": self.filesystem,
            "autoexport_job": self.autoexport_job,
            "endpoint": self.endpoint,
        }
        values.update(overrides)
        return AmlfsTarget(**values)

    def config_values(self) -> dict[str, str]:
        """The amlfs.* settings of a node config that points at this double."""
        return {
            "subscription_id": self.subscription_id,
            "resource_group": self.resource_group,
            "filesystem": self.filesystem,
            "autoexport_job": self.autoexport_job,
            "arm_endpoint": self.endpoint,
        }

    def kinds(self, prefix: str = "") -> list[str]:
        """The request log as kinds ("autoexport.patch:Disable", "import.put", ...), in order."""
        with self.lock:
            return [r.kind for r in self.requests if r.kind.startswith(prefix)]

    def import_jobs(self) -> dict[str, dict[str, Any]]:
        with self.lock:
            return {k: json.loads(json.dumps(v["body"])) for k, v in self._imports.items()}

    # -- dispatch --------------------------------------------------------------------------------

    def handle(self, method: str, raw_path: str, headers: dict[str, str], raw: bytes) -> tuple[int, dict[str, str], Any]:
        parts = urlsplit(raw_path)
        path = parts.path
        query = parse_qs(parts.query)
        try:
            body = json.loads(raw) if raw else None
        except ValueError:
            body = None
        kind, m = "unknown", None
        for name, rx in _ROUTES:
            m = rx.match(path)
            if m:
                kind = name
                break
        kind = f"{kind}.{method.lower()}"
        if kind == "autoexport.patch" and isinstance(body, dict):
            kind += ":" + str((body.get("properties") or {}).get("adminStatus"))
        with self.lock:
            status, out_headers, out = self._respond(kind, method, path, query, headers, body, m)
            self.requests.append(Request(method, path, kind, body, status))
        return status, out_headers, out

    def _respond(
        self, kind: str, method: str, path: str, query: dict[str, list[str]], headers: dict[str, str], body: Any, m: Any
    ) -> tuple[int, dict[str, str], Any]:
        sc = self.scenario
        auth = {k.lower(): v for k, v in headers.items()}.get("authorization", "")
        if not auth.startswith("Bearer "):
            return 401, {"WWW-Authenticate": 'Bearer authorization_uri="https://login.microsoftonline.com/common"'}, _err(
                "AuthenticationFailed", "Authentication failed. The 'Authorization' header is missing."
            )
        if query.get("api-version") != [KIND_API_VERSIONS.get(kind.split(".")[0], API_VERSION)]:
            return 400, {}, _err("InvalidApiVersionParameter", f"The api-version '{query.get('api-version')}' is invalid.")
        base = kind.split(":")[0]
        denied = self._authorize(auth[len("Bearer "):], base, path)
        if denied is not None:
            return denied
        queue = sc.faults.get(base) or sc.faults.get(kind)
        if queue:
            code = queue.pop(0)
            return code, {}, _err("ServiceUnavailable" if code >= 500 else "BadRequest", f"injected fault {code}")
        if base in sc.deny or kind in sc.deny:
            return 403, {}, _err(
                "AuthorizationFailed",
                "The client '11111111-1111-1111-1111-111111111111' with object id '11111111-1111-1111-1111-111111111111' "
                f"does not have authorization to perform action '{_action(base)}' over scope '{path}' or the scope is "
                "invalid. If access was recently granted, please refresh your credentials.",
            )
        if m is None:
            return 404, {}, _err("InvalidResourceType", f"The resource type could not be found for {path}.")
        g = m.groupdict()
        if g.get("sub") and g["sub"] != self.subscription_id:
            return 404, {}, _err("SubscriptionNotFound", f"The subscription '{g['sub']}' could not be found.")
        if "fs" in g and (g["rg"].lower() != self.resource_group.lower() or g["fs"].lower() != self.filesystem.lower()):
            return 404, {}, _not_found("amlFilesystems", g["fs"], g["rg"])

        if base == "asyncop.get":
            return self._asyncop(g["op"])
        if base == "fs.get":
            return 200, {}, self._fs_body()
        if base == "skus.get":
            return 200, {}, {"value": self._skus()}
        if base == "computeSkus.get":
            return self._compute_skus(query)
        if base == "provider.get":
            return 200, {}, self._provider()
        if base == "fss.get":     # amlFilesystems_ListByResourceGroup.json
            here = g["rg"].lower() == self.resource_group.lower()
            return 200, {}, {"value": [self._fs_body()] if here else []}
        if base == "archive.post":
            return self._start_archive(body)
        if base == "cancelArchive.post":
            if self._archive and self._archive["state"] in ("InProgress", "FSScanInProgress"):
                self._archive["state"] = "Cancelling"
            return 200, {}, None
        if base in ("autoexport.get", "autoexport.patch"):
            if g["job"].lower() != self.autoexport_job.lower():
                return 404, {}, _not_found("amlFilesystems/autoExportJobs", f"{self.filesystem}/{g['job']}", g["rg"])
            if base == "autoexport.get":
                self._advance_autoexport()
                return 200, {}, self._autoexport_body()
            return self._patch_autoexport(body)
        if base == "autoexports.get":
            return 200, {}, {"value": [self._autoexport_body()]}
        if base == "imports.get":
            return 200, {}, {"value": [self._advance_import(n) for n in list(self._imports)]}
        if base.startswith("import."):
            return self._import(method, g["job"], body)
        return 405, {}, _err("MethodNotAllowed", f"{method} is not supported on {path}")

    # -- async operations --------------------------------------------------------------------------

    def _new_op(self, result: str = "Succeeded", error: tuple[str, str] | None = None) -> dict[str, str]:
        op_id = str(uuid.uuid4())
        self._ops[op_id] = {"left": self.scenario.lro_polls, "result": result, "error": error, "start": _now()}
        url = f"{self.endpoint}/subscriptions/{self.subscription_id}/providers/Microsoft.StorageCache/locations/{self.location}/ascOperations/{op_id}"
        return {
            "Azure-AsyncOperation": f"{url}?api-version={API_VERSION}",
            "Location": f"{url}?monitor=true&api-version={API_VERSION}",
        }

    def _asyncop(self, op_id: str) -> tuple[int, dict[str, str], Any]:
        op = self._ops.get(op_id)
        if op is None:
            return 404, {}, _err("NotFound", f"operation {op_id} not found")
        body: dict[str, Any] = {
            "name": op_id,
            "id": f"/subscriptions/{self.subscription_id}/providers/Microsoft.StorageCache/locations/{self.location}/ascOperations/{op_id}",
            "startTime": op["start"],
        }
        if op["left"] > 0:
            op["left"] -= 1
            body["status"] = "InProgress"
            return 200, {}, body
        body["status"] = op["result"]
        body["endTime"] = _now()
        if op["error"]:
            body["error"] = {"code": op["error"][0], "message": op["error"][1]}
        return 200, {}, body

    # -- auto-export --------------------------------------------------------------------------------

    def _autoexport_body(self) -> dict[str, Any]:
        return {
            "name": self.autoexport_job,
            "type": "Microsoft.StorageCache/amlFilesystem/autoExportJob",
            "id": f"{self._fs_id()}/autoExportJobs/{self.autoexport_job}",
            "location": self.location,
            "properties": {
                "adminStatus": self.scenario.autoexport_admin,
                "autoExportPrefixes": list(self.scenario.autoexport_prefixes),
                "provisioningState": self._ae_provisioning(),
                "status": dict(self.scenario.autoexport),
            },
        }

    def _ae_provisioning(self) -> str:
        u = self._ae_update
        if u is None:
            return "Succeeded"
        return "Updating" if u["left"] >= 0 else u["result"]

    def _advance_autoexport(self) -> None:
        u = self._ae_update
        if u is not None and u["left"] >= 0:
            # A PATCH is applied over `lro_polls` GETs (the job reads Updating meanwhile), then
            # ends Succeeded or Failed; the async-operation monitor reports the same outcome.
            u["left"] -= 1
        st = self.scenario.autoexport
        if self.scenario.iterate_on_get and st.get("state") == "InProgress":
            st["exportIterationCount"] = int(st.get("exportIterationCount", 0)) + 1
        if st.get("state") == "Disabling":
            if self._disabling_left > 0:
                self._disabling_left -= 1
            else:
                st["state"] = self.scenario.disable_result
                st["statusMessage"] = (
                    "Auto Export is disabled" if st["state"] == "Disabled" else "Auto Export failed to disable"
                )

    def _blob_job_running(self) -> str | None:
        for name, job in self._imports.items():
            if job["body"]["properties"]["status"]["state"] in ("InProgress", "Cancelling"):
                return f"import job {name}"
        if self._archive and self._archive["state"] in ("InProgress", "FSScanInProgress", "Cancelling"):
            return "an archive job"
        return None

    def _patch_autoexport(self, body: Any) -> tuple[int, dict[str, str], Any]:
        sc = self.scenario
        admin = ((body or {}).get("properties") or {}).get("adminStatus")
        if admin not in ("Enable", "Disable"):
            return 400, {}, _err("InvalidParameter", "properties.adminStatus must be Enable or Disable.")
        if admin == "Disable":
            sc.autoexport_admin = "Disable"
            if sc.autoexport.get("state") != "Disabled":
                sc.autoexport["state"] = "Disabling"
                sc.autoexport["statusMessage"] = "Auto Export is disabling"
                self._disabling_left = sc.disable_polls
            self._ae_update = {"left": sc.lro_polls, "result": "Succeeded"}
            return 202, self._new_op(), None
        # Enable
        if sc.enable_fails == "http":
            return sc.enable_status, {}, _err("InternalServerError" if sc.enable_status >= 500 else "BadRequest",
                                              "Auto Export job could not be enabled.")
        running = self._blob_job_running() if sc.one_blob_job else None
        if running:
            return 409, {}, _err("Conflict", f"Cannot enable auto export while {running} is running; only one blob job can run at a time.")
        if sc.enable_fails == "lro":
            # Accepted, then the update fails: adminStatus stays Disable, provisioningState Failed.
            self._ae_update = {"left": sc.lro_polls, "result": "Failed"}
            return 202, self._new_op("Failed", ("InternalServerError", "Auto Export job could not be enabled.")), None
        sc.autoexport_admin = "Enable"
        sc.autoexport["state"] = "InProgress"
        sc.autoexport["statusMessage"] = "Auto Export is in progress"
        self._ae_update = {"left": sc.lro_polls, "result": "Succeeded"}
        return 202, self._new_op(), None

    # -- import jobs -----------------------------------------------------------------------------------

    def _import(self, method: str, name: str, body: Any) -> tuple[int, dict[str, str], Any]:
        sc = self.scenario
        if method == "PUT":
            props = (body or {}).get("properties") or {}
            if not (body or {}).get("location"):
                return 400, {}, _err("LocationRequired", "The location property is required for this definition.")
            prefixes = props.get("importPrefixes") or ["/"]
            if sc.one_blob_job:
                busy = self._blob_job_running()
                if busy is None and sc.autoexport.get("state") != "Disabled":
                    busy = f"auto export job {self.autoexport_job} (state {sc.autoexport.get('state')})"
                if busy:
                    return 409, {}, _err("Conflict", f"Cannot create import job {name} while {busy} is active; only one blob job can run at a time.")
            job = {
                "name": name,
                "type": "Microsoft.StorageCache/amlFilesystem/importJob",
                "id": f"{self._fs_id()}/importJobs/{name}",
                "location": body["location"],
                "properties": {
                    "adminStatus": "Active",
                    "conflictResolutionMode": props.get("conflictResolutionMode", "Fail"),
                    "importPrefixes": prefixes,
                    "maximumErrors": props.get("maximumErrors", 0),
                    "provisioningState": "Succeeded",
                    "status": {
                        "blobsImportedPerSecond": 0,
                        "blobsWalkedPerSecond": 0,
                        "lastStartedTime": _now(),
                        "state": "InProgress",
                        "statusMessage": "Import job is in progress",
                        "totalBlobsImported": 0,
                        "totalBlobsWalked": 0,
                        "totalConflicts": 0,
                        "totalErrors": 0,
                    },
                },
            }
            if body.get("tags"):
                job["tags"] = body["tags"]
            self._imports[name] = {"body": job, "left": sc.import_polls, "total": sc.import_polls}
            return 201, {"Azure-AsyncOperation": self._new_op()["Azure-AsyncOperation"]}, job
        if name not in self._imports:
            return 404, {}, _not_found("amlFilesystems/importJobs", f"{self.filesystem}/{name}", self.resource_group)
        if method == "GET":
            return 200, {}, self._advance_import(name)
        if method == "PATCH":
            admin = ((body or {}).get("properties") or {}).get("adminStatus")
            st = self._imports[name]["body"]["properties"]["status"]
            if admin == "Cancel" and st["state"] == "InProgress":
                st["state"] = "Cancelling"
                st["statusMessage"] = "Import job is cancelling"
                self._imports[name]["body"]["properties"]["adminStatus"] = "Cancel"
            return 202, self._new_op(), None
        if method == "DELETE":
            del self._imports[name]
            return 202, self._new_op(), None
        return 405, {}, _err("MethodNotAllowed", f"{method} not supported")

    def _advance_import(self, name: str) -> dict[str, Any]:
        sc = self.scenario
        rec = self._imports[name]
        job = rec["body"]
        st = job["properties"]["status"]
        if st["state"] == "Cancelling":
            st.update(state="Canceled", statusMessage="Import job was canceled", lastCompletionTime=_now())
        elif st["state"] == "InProgress":
            if rec["left"] > 0:
                rec["left"] -= 1
                done = rec["total"] - rec["left"]
                st["totalBlobsWalked"] = sc.import_blobs * done // (rec["total"] + 1)
                st["totalBlobsImported"] = st["totalBlobsWalked"]
            else:
                walked, errors = sc.import_blobs, sc.import_errors
                imported = walked - errors
                if sc.import_result in ("Completed", "CompletedPartial") and sc.import_hook is not None:
                    got = sc.import_hook(list(job["properties"]["importPrefixes"]), job["properties"]["conflictResolutionMode"])
                    if got is not None:
                        walked, imported, errors = got
                if sc.import_result == "Failed":
                    imported = 0
                msg = {
                    "Completed": "Import job completed successfully",
                    "CompletedPartial": f"Import job completed with {errors} errors",
                    "Failed": "Import job failed",
                    "Canceled": "Import job was canceled",
                }.get(sc.import_result, sc.import_result)
                st.update(
                    state=sc.import_result,
                    statusMessage=msg,
                    totalBlobsWalked=walked,
                    totalBlobsImported=imported,
                    importedFiles=imported,
                    totalErrors=errors,
                    lastCompletionTime=_now(),
                )
        return json.loads(json.dumps(job))

    # -- file system and manual archive ----------------------------------------------------------------

    def _fs_id(self) -> str:
        return (
            f"/subscriptions/{self.subscription_id}/resourceGroups/{self.resource_group}"
            f"/providers/Microsoft.StorageCache/amlFilesystems/{self.filesystem}"
        )

    def _start_archive(self, body: Any) -> tuple[int, dict[str, str], Any]:
        sc = self.scenario
        path = (body or {}).get("filesystemPath") or "/"
        if sc.one_blob_job:
            busy = self._blob_job_running()
            if busy is None and sc.autoexport.get("state") != "Disabled":
                busy = f"auto export job {self.autoexport_job} (state {sc.autoexport.get('state')})"
            if busy:
                return 409, {}, _err("Conflict", f"Cannot start an archive while {busy} is active; only one blob job can run at a time.")
        self._archive = {"path": path, "state": "InProgress", "left": sc.archive_polls, "total": sc.archive_polls,
                         "start": _now(), "percent": 0}
        return 200, {}, None

    def _advance_archive(self) -> None:
        a, sc = self._archive, self.scenario
        if a is None:
            return
        if a["state"] == "Cancelling":
            a.update(state="Canceled", end=_now())
        elif a["state"] == "InProgress":
            if a["left"] > 0:
                a["left"] -= 1
                a["percent"] = 100 * (a["total"] - a["left"]) // (a["total"] + 1)
            else:
                if sc.archive_result == "Completed" and sc.archive_hook is not None:
                    sc.archive_hook(a["path"])
                a.update(state=sc.archive_result, end=_now(), percent=100 if sc.archive_result == "Completed" else a["percent"])

    def _skus(self) -> list[dict[str, Any]]:
        if self.scenario.skus is not None:
            return self.scenario.skus
        return [{"resourceType": "amlFilesystems", "name": f"AMLFS-Durable-Premium-{tier}", "locations": [self.location],
                 "locationInfo": [{"location": self.location, "zones": ["1", "2", "3"]}],
                 "capabilities": [{"name": "bandwidth (MB/s/TiB)", "value": str(tier)}], "restrictions": []}
                for tier in (40, 125, 250, 500)]

    def _compute_skus(self, query: dict[str, list[str]]) -> tuple[int, dict[str, str], Any]:
        entries = self.scenario.compute_skus if self.scenario.compute_skus is not None else default_compute_skus(self.location)
        flt = (query.get("$filter") or [""])[0]
        if flt:
            m = re.fullmatch(r"\s*location\s+eq\s+'([^']+)'\s*", flt, re.I)
            if m is None:     # the spec: "Only **location** filter is supported currently"
                return 400, {}, _err("InvalidFilter", f"The filter '{flt}' is not supported; only location is.")
            loc = m.group(1).replace(" ", "").lower()
            entries = [e for e in entries if loc in {str(x).replace(" ", "").lower() for x in e.get("locations", [])}]
        start = int((query.get("$skiptoken") or ["0"])[0])
        size = self.scenario.compute_skus_page or len(entries) or 1
        page, rest = entries[start:start + size], entries[start + size:]
        body: dict[str, Any] = {"value": page, "nextLink": None}
        if rest:
            q = f"api-version={KIND_API_VERSIONS['computeSkus']}&$skiptoken={start + size}" + (f"&$filter={flt}" if flt else "")
            body["nextLink"] = f"{self.endpoint}/subscriptions/{self.subscription_id}/providers/Microsoft.Compute/skus?{q}"
        return 200, {}, body

    def _provider(self) -> dict[str, Any]:
        if self.scenario.provider is not None:
            return self.scenario.provider
        display = {"eastus": "East US", "westeurope": "West Europe"}.get(self.location, self.location)
        return {"id": f"/subscriptions/{self.subscription_id}/providers/Microsoft.StorageCache", "namespace": "Microsoft.StorageCache",
                "registrationState": "Registered", "registrationPolicy": "RegistrationRequired",
                "resourceTypes": [{"resourceType": "amlFilesystems", "locations": [display], "apiVersions": [API_VERSION],
                                   "zoneMappings": [{"location": display, "zones": ["1", "2", "3"]}]}]}

    def _fs_body(self) -> dict[str, Any]:
        self._advance_archive()
        sa = f"/subscriptions/{self.subscription_id}/resourceGroups/{self.resource_group}/providers/Microsoft.Storage/storageAccounts/storageaccountname/blobServices/default/containers"
        hsm: dict[str, Any] = {
            "settings": {
                "container": f"{sa}/checkpoints",
                "importPrefixesInitial": ["/"],
                "loggingContainer": f"{sa}/logs",
            }
        }
        a = self._archive
        if a is not None:
            status: dict[str, Any] = {"lastStartedTime": a["start"], "state": a["state"], "percentComplete": a["percent"]}
            if a.get("end"):
                status["lastCompletionTime"] = a["end"]
            if a["state"] == "Failed":
                status["errorCode"] = "ArchiveFailed"
                status["errorMessage"] = "Archive failed: 3 files could not be exported"
            hsm["archiveStatus"] = [{"filesystemPath": a["path"], "status": status}]
        return {
            "name": self.filesystem,
            "type": "Microsoft.StorageCache/amlFilesystem",
            "id": self._fs_id(),
            "location": self.location,
            "properties": {
                "clientInfo": {
                    "lustreVersion": "2.15.0",
                    "mgsAddress": "10.0.0.4",
                    "mountCommand": "mount -t lustre 10.0.0.4@tcp:/lustrefs /lustre/lustrefs",
                },
                "clusterUuid": "00000000-0000-0000-0000-000000000001",
                "filesystemSubnet": f"/subscriptions/{self.subscription_id}/resourceGroups/{self.resource_group}/providers/Microsoft.Network/virtualNetworks/scvnet/subnets/fsSub",
                "health": {"state": "Available", "statusDescription": "amlFilesystem is ok."},
                "hsm": hsm,
                "maintenanceWindow": {"dayOfWeek": "Friday", "timeOfDayUTC": "22:00"},
                "provisioningState": "Succeeded",
                "storageCapacityTiB": 16,
                "throughputProvisionedMBps": 500,
            },
            "sku": {"name": "AMLFS-Durable-Premium-250"},
            "zones": ["1"],
        }


# Kinds served at another api-version than the StorageCache operations.
KIND_API_VERSIONS = {"computeSkus": "2021-07-01", "provider": "2021-04-01"}


def compute_sku(name: str, location: str, family: str, *, zones: tuple[str, ...] = ("1", "2", "3"),
                trusted_launch_disabled: bool = False, restrictions: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """One virtualMachines entry shaped like ListAvailableResourceSkusForARegion.json (2021-07-01)."""
    caps = [{"name": "HyperVGenerations", "value": "V2"}, {"name": "AcceleratedNetworkingEnabled", "value": "True"}]
    if trusted_launch_disabled:
        caps.append({"name": "TrustedLaunchDisabled", "value": "True"})
    return {"resourceType": "virtualMachines", "locations": [location], "capabilities": caps,
            "locationInfo": [{"location": location, "zones": list(zones), "zoneDetails": []}],
            "name": name, "tier": "Standard", "size": name.removeprefix("Standard_"), "family": family,
            "restrictions": restrictions or []}


def default_compute_skus(location: str) -> list[dict[str, Any]]:
    return [
        compute_sku("Standard_ND96isr_H100_v5", location, "standardNDSH100v5Family"),
        compute_sku("Standard_ND96isr_H200_v5", location, "standardNDSH200v5Family"),
        compute_sku("Standard_ND96amsr_A100_v4", location, "StandardNDAMSv4_A100Family", trusted_launch_disabled=True),
        compute_sku("Standard_ND96asr_v4", location, "standardNDASv4_A100Family", trusted_launch_disabled=True),
        *(compute_sku(f"Standard_D{n}s_v5", location, "standardDSv5Family") for n in (4, 8, 16)),
    ]


def _err(code: str, message: str) -> dict[str, Any]:
    return {"error": {"code": code, "message": message}}


def _not_found(rtype: str, name: str, rg: str) -> dict[str, Any]:
    return _err(
        "ResourceNotFound",
        f"The Resource 'Microsoft.StorageCache/{rtype}/{name}' under resource group '{rg}' was not found. "
        "For more details please go to https://aka.ms/ARMResourceNotFoundFix",
    )


def _principal(token: str) -> str:
    """A stable object id per token, for ARM-shaped error messages."""
    return str(uuid.uuid5(uuid.NAMESPACE_URL, "arm-double-principal:" + token))


def _action(kind: str) -> str:
    base = "Microsoft.StorageCache/amlFilesystems"
    return {
        # The async-operation monitor lives at subscription scope, not under the file system.
        "asyncop.get": "Microsoft.StorageCache/locations/ascoperations/read",
        # The SKU list is a subscription-scope read (Skus_List): the program's preflight needs it, nodes never.
        "skus.get": "Microsoft.StorageCache/skus/read",
        "computeSkus.get": "Microsoft.Compute/skus/read",
        # Reading a provider's registration: this double's choice of action name (Contributor's "*" covers it).
        "provider.get": "Microsoft.Resources/subscriptions/providers/read",
        "autoexports.get": f"{base}/autoExportJobs/read",
        "fs.get": f"{base}/read",
        "fss.get": f"{base}/read",
        "archive.post": f"{base}/archive/action",
        "cancelArchive.post": f"{base}/cancelArchive/action",
        "autoexport.get": f"{base}/autoExportJobs/read",
        "autoexport.patch": f"{base}/autoExportJobs/write",
        "import.get": f"{base}/importJobs/read",
        "imports.get": f"{base}/importJobs/read",
        "import.put": f"{base}/importJobs/write",
        "import.patch": f"{base}/importJobs/write",
        "import.delete": f"{base}/importJobs/delete",
    }.get(kind, f"{base}/read")


# -- what the service does with the data: optional hooks that move bytes between a local "mount"
# directory (standing in for /lustrefs) and a Blob container (Azurite), with AMLFS's name mapping:
# blob <p> <-> <mount>/<p>.


def blob_import_hook(connection_string: str, container: str, mount: Path) -> Callable[[list[str], str], tuple[int, int, int]]:
    """scenario.import_hook that copies the blobs under each import prefix to <mount>/<blob name>.

    Skip keeps an existing file; Fail counts it as an error; OverwriteIfDirty and OverwriteAlways
    replace it (no HSM dirty state here). Returns (walked, imported, errors) for the job status."""
    from azure.storage.blob import ContainerClient

    def hook(prefixes: list[str], mode: str) -> tuple[int, int, int]:
        cc = ContainerClient.from_connection_string(connection_string, container)
        walked = imported = errors = 0
        for prefix in prefixes:
            for blob in cc.list_blobs(name_starts_with=prefix.lstrip("/")):
                walked += 1
                dest = mount / blob.name
                if dest.exists() and mode in ("Skip", "Fail"):
                    errors += mode == "Fail"
                    continue
                dest.parent.mkdir(parents=True, exist_ok=True)
                tmp = dest.with_name(dest.name + ".importing")
                with open(tmp, "wb") as f:
                    cc.download_blob(blob.name).readinto(f)
                tmp.replace(dest)
                imported += 1
        return walked, imported, errors

    return hook


def blob_archive_hook(connection_string: str, container: str, mount: Path) -> Callable[[str], None]:
    """scenario.archive_hook that uploads every file under <mount>/<filesystemPath> to its blob name."""
    from azure.storage.blob import ContainerClient

    def hook(filesystem_path: str) -> None:
        cc = ContainerClient.from_connection_string(connection_string, container)
        base = mount / filesystem_path.lstrip("/")
        for path in sorted(p for p in base.rglob("*") if p.is_file()):
            with open(path, "rb") as f:
                cc.upload_blob(path.relative_to(mount).as_posix(), f, overwrite=True)

    return hook
