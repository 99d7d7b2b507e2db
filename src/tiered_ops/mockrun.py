"""Run the real Pulumi program under Pulumi's mock runtime: no credentials, no Pulumi CLI, no cloud.

Shared by tiered_ops.preview (offline preview) and tests/infra. Each run happens in a brand-new
contextvars.Context, so the program runs fresh every time (new root stack, new config).
The mocks answer like Azure Resource Manager would: ARM-shaped resource IDs, names, the few
computed properties the program reads (blob endpoint, MGS address, identity IDs), keyed on the
resource type token.
"""
from __future__ import annotations

import asyncio
import contextlib
import contextvars
import json
import pickle
import runpy
import uuid
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from tiered_ckpt.errors import UserError
from tiered_ops import PROJECT_ROOT as ROOT

MOCK_SUBSCRIPTION = "00000000-0000-0000-0000-0000000000aa"
MOCK_TENANT = "00000000-0000-0000-0000-0000000000bb"
MOCK_RP_OBJECT_ID = "00000000-0000-0000-0000-0000000000cc"
MOCK_MGS = "10.42.0.4"
MOCK_PUBLIC_IP = "198.51.100.7"           # a documentation address (RFC 5737)
MOCK_STAMP = 1767225600                   # time:Static's unix seconds
WAIT_TYPE = "pulumi-python:dynamic/tiered:WaitForBlobJobs"
# Used by the offline preview only when the stack has no sshPublicKey (it is per operator); flagged in the output.
PREVIEW_SSH_KEY = "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIPreviewOnlyPlaceholderNotARealKeyxxxxxxxxxx preview-placeholder"


class PreviewError(UserError):
    """The program refused the settings (the message is the program's own, e.g. a SettingsError)."""


@dataclass
class Res:
    type: str
    name: str
    urn: str
    parent: str
    custom: bool
    inputs: dict[str, Any]
    deps: list[str]
    protect: bool
    timeouts: dict[str, str]
    id: str = ""
    state: dict[str, Any] = field(default_factory=dict)
    replace_on_changes: list[str] = field(default_factory=list)
    delete_before_replace: bool = False
    retain_on_delete: bool = False


@dataclass
class PreviewResult:
    stack: str
    config: dict[str, str]
    resources: list[Res]
    outputs: dict[str, Any]
    notes: list[str]
    invokes: list[tuple[str, dict[str, Any]]] = field(default_factory=list)

    def of_type(self, token: str) -> list[Res]:
        return [r for r in self.resources if r.type == token]

    def one(self, token: str, contains: str = "") -> Res:
        found = [r for r in self.of_type(token) if contains in r.name]
        if len(found) != 1:
            raise AssertionError(f"expected one {token} named *{contains}*, found {[r.name for r in found]}")
        return found[0]

    def by_urn(self, urn: str) -> Res:
        return next(r for r in self.resources if r.urn == urn)

    def depends_on(self, res: Res, other: Res) -> bool:
        """True if `res` waits for `other` (directly, or through a dependency on a component containing it)."""
        seen, todo = set(), list(res.deps)
        while todo:
            urn = todo.pop()
            if urn == other.urn:
                return True
            if urn in seen:
                continue
            seen.add(urn)
            dep = next((r for r in self.resources if r.urn == urn), None)
            if dep is not None:
                todo.extend(dep.deps)
        return False


def _scalar(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (dict, list)):
        return json.dumps(v)
    return str(v)


def stack_config(stack: str, overrides: Mapping[str, str] | None = None, root: Path = ROOT) -> dict[str, str]:
    """Pulumi.yaml defaults, then stacks/Pulumi.<stack>.yaml, then overrides; keys `<project>:<key>`."""
    project = yaml.safe_load((root / "Pulumi.yaml").read_text())
    ns = project["name"]
    cfg: dict[str, str] = {}
    for key, spec in (project.get("config") or {}).items():
        full = key if ":" in key else f"{ns}:{key}"
        if isinstance(spec, dict) and "default" in spec:
            cfg[full] = _scalar(spec["default"])
    stack_file = root / project.get("stackConfigDir", ".") / f"Pulumi.{stack}.yaml"
    if not stack_file.exists():
        raise PreviewError(f"stack {stack!r}: {stack_file} not found; use one of "
                        f"{', '.join(sorted(p.stem.split('.', 1)[1] for p in stack_file.parent.glob('Pulumi.*.yaml')))}")
    for key, value in (yaml.safe_load(stack_file.read_text()) or {}).get("config", {}).items():
        cfg[key if ":" in key else f"{ns}:{key}"] = _scalar(value)
    for key, value in (overrides or {}).items():
        cfg[key if ":" in key else f"{ns}:{key}"] = _scalar(value)
    return cfg


def _guid(*parts: str) -> str:
    return str(uuid.uuid5(uuid.NAMESPACE_URL, "/".join(parts)))


def _arm_id(typ: str, name: str, inputs: dict[str, Any]) -> str:
    sub = f"/subscriptions/{MOCK_SUBSCRIPTION}"
    rg = f"{sub}/resourceGroups/{inputs.get('resourceGroupName', 'rg')}"
    if typ == "azure-native:resources:ResourceGroup":
        return f"{sub}/resourceGroups/{name}"
    acct = f"{rg}/providers/Microsoft.Storage/storageAccounts/{inputs.get('accountName', '')}"
    paths = {
        "azure-native:resources:ResourceGroup": f"{sub}/resourceGroups/{name}",
        "azure-native:storage:StorageAccount": f"{rg}/providers/Microsoft.Storage/storageAccounts/{name}",
        "azure-native:storage:BlobContainer": f"{acct}/blobServices/default/containers/{name}",
        "azure-native:storage:BlobServiceProperties": f"{acct}/blobServices/default",
        "azure-native:storage:ManagementPolicy": f"{acct}/managementPolicies/default",
        "azure-native:storage:Blob": f"{acct}/blobServices/default/containers/{inputs.get('containerName')}/blobs/{name}",
        "azure-native:network:VirtualNetwork": f"{rg}/providers/Microsoft.Network/virtualNetworks/{name}",
        "azure-native:network:Subnet": f"{rg}/providers/Microsoft.Network/virtualNetworks/{inputs.get('virtualNetworkName')}/subnets/{name}",
        "azure-native:network:NetworkSecurityGroup": f"{rg}/providers/Microsoft.Network/networkSecurityGroups/{name}",
        "azure-native:network:NatGateway": f"{rg}/providers/Microsoft.Network/natGateways/{name}",
        "azure-native:network:PublicIPAddress": f"{rg}/providers/Microsoft.Network/publicIPAddresses/{name}",
        "azure-native:storagecache:AmlFilesystem": f"{rg}/providers/Microsoft.StorageCache/amlFilesystems/{name}",
        "azure-native:storagecache:AutoExportJob": f"{rg}/providers/Microsoft.StorageCache/amlFilesystems/{inputs.get('amlFilesystemName')}/autoExportJobs/{name}",
        "azure-native:managedidentity:UserAssignedIdentity": f"{rg}/providers/Microsoft.ManagedIdentity/userAssignedIdentities/{name}",
        "azure-native:compute:VirtualMachineScaleSet": f"{rg}/providers/Microsoft.Compute/virtualMachineScaleSets/{name}",
        "azure-native:compute:VirtualMachine": f"{rg}/providers/Microsoft.Compute/virtualMachines/{name}",
        "azure-native:network:NetworkInterface": f"{rg}/providers/Microsoft.Network/networkInterfaces/{name}",
        "azure-native:network:BastionHost": f"{rg}/providers/Microsoft.Network/bastionHosts/{name}",
        "azure-native:keyvault:Vault": f"{rg}/providers/Microsoft.KeyVault/vaults/{name}",
        "azure-native:authorization:RoleAssignment": f"{inputs.get('scope', sub)}/providers/Microsoft.Authorization/roleAssignments/{_guid(name)}",
        "azure-native:authorization:RoleDefinition": f"{sub}/providers/Microsoft.Authorization/roleDefinitions/{_guid(name)}",
    }
    return paths.get(typ, f"{rg}/providers/Mock/{typ.replace(':', '.')}/{name}")


def _mock_state(typ: str, logical: str, inputs: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    from components.settings.azure import SKUS

    name_key = {"azure-native:storage:StorageAccount": "accountName", "azure-native:storage:BlobContainer": "containerName",
                "azure-native:storage:Blob": "blobName", "azure-native:storagecache:AmlFilesystem": "amlFilesystemName",
                "azure-native:storagecache:AutoExportJob": "autoExportJobName",
                "azure-native:resources:ResourceGroup": "resourceGroupName",
                "azure-native:compute:VirtualMachine": "vmName", "azure-native:network:BastionHost": "bastionHostName",
                "azure-native:keyvault:Vault": "vaultName", "azure-native:network:Subnet": "subnetName"}.get(typ)
    name = str(inputs.get(name_key) or logical) if name_key else logical
    state = dict(inputs)
    state["name"] = name
    if typ == "azure-native:storage:StorageAccount":
        state["primaryEndpoints"] = {"blob": f"https://{name}.blob.core.windows.net/"}
    elif typ == "azure-native:storagecache:AmlFilesystem":
        sku = SKUS[inputs["sku"]["name"]]
        state["clientInfo"] = {"mgsAddress": MOCK_MGS, "lustreVersion": "2.15",
                               "mountCommand": f"sudo mount -t lustre -o noatime,flock {MOCK_MGS}@tcp:/lustrefs /lustrefs",
                               "containerStorageInterface": {}}
        state["throughputProvisionedMBps"] = int(sku.mbps_per_tib * inputs["storageCapacityTiB"])
    elif typ == "azure-native:managedidentity:UserAssignedIdentity":
        state["clientId"] = _guid(name, "client")
        state["principalId"] = _guid(name, "principal")
    elif typ in ("azure-native:compute:VirtualMachineScaleSet", "azure-native:compute:VirtualMachine"):
        # ARM answers userAssignedIdentities as a map keyed by identity ID (the request sends a list).
        ident = dict(inputs.get("identity") or {})
        ident["userAssignedIdentities"] = {i: {"clientId": _guid(i, "client"), "principalId": _guid(i, "principal")}
                                           for i in ident.get("userAssignedIdentities") or []}
        state["identity"] = ident
    elif typ == "azure-native:network:PublicIPAddress":
        state["ipAddress"] = MOCK_PUBLIC_IP
    elif typ == "time:index/static:Static":
        state["unix"] = MOCK_STAMP
    elif typ == WAIT_TYPE:
        state["import_states"] = ["Completed"]
    return _arm_id(typ, name, inputs), state


@contextlib.contextmanager
def _pickler_restored() -> Iterator[None]:
    """Put back the pure-Python pickler's methods that pulumi's dynamic provider serializer patches.

    pulumi.dynamic.dynamic.serialize_provider wraps `pickle._Pickler._batch_setitems` in a sorting
    wrapper on every call and never unwraps it (pulumi/pulumi#17803). One `pulumi up` calls it once
    per dynamic resource; a process that runs the program many times (the test suite, `make plan`
    for several stacks) nests the wrappers until pickling hits RecursionError.
    """
    names = ("_batch_setitems", "save_dict")
    saved = {n: pickle._Pickler.__dict__[n] for n in names}
    pickler = pickle.Pickler
    try:
        yield
    finally:
        for n, v in saved.items():
            setattr(pickle._Pickler, n, v)
        pickle.Pickler = pickler  # type: ignore[misc]


def _run_in_fresh_context(main: Path, stack: str, config: dict[str, str],
                          invokes: list[tuple[str, dict[str, Any]]]) -> tuple[list[Res], dict[str, Any]]:
    import pulumi
    from pulumi.runtime import mocks, settings
    from pulumi.runtime.config import set_all_config
    from pulumi.runtime.stack import run_pulumi_func, wait_for_rpcs
    from pulumi.runtime.sync_await import _sync_await

    records: dict[str, Res] = {}

    class Mocks(pulumi.runtime.Mocks):
        def new_resource(self, args: pulumi.runtime.MockResourceArgs) -> tuple[str | None, dict]:
            rid, state = _mock_state(args.typ, args.name, dict(args.inputs))
            # A snapshot: the engine registers further resources on other threads meanwhile
            # ("dictionary changed size during iteration" under load).
            for rec in list(records.values()):
                if rec.type == args.typ and rec.name == args.name:
                    rec.id, rec.state = rid, state
            return rid, state

        def call(self, args: pulumi.runtime.MockCallArgs) -> tuple[dict, list[tuple[str, str]]]:
            invokes.append((args.token, dict(args.args)))
            if args.token == "azure-native:authorization:getClientConfig":
                return {"subscriptionId": MOCK_SUBSCRIPTION, "tenantId": MOCK_TENANT,
                        "clientId": _guid("operator"), "objectId": _guid("operator-oid")}, []
            if args.token == "azuread:index/getServicePrincipal:getServicePrincipal":
                return {"objectId": MOCK_RP_OBJECT_ID, "clientId": args.args.get("clientId"),
                        "displayName": "HPC Cache Resource Provider", "id": f"/servicePrincipals/{MOCK_RP_OBJECT_ID}"}, []
            raise NotImplementedError(f"mock has no answer for invoke {args.token}")

    class RecordingMonitor(mocks.MockMonitor):
        def RegisterResource(self, request: Any) -> Any:  # noqa: N802 (gRPC method name)
            from pulumi.runtime import rpc

            urn = self.make_urn(request.parent, request.type, request.name)
            if request.type != "pulumi:pulumi:Stack":
                t = request.customTimeouts
                records[urn] = Res(
                    type=request.type, name=request.name, urn=urn, parent=request.parent, custom=bool(request.custom),
                    inputs=rpc.deserialize_properties(request.object) if request.custom else {},
                    deps=list(request.dependencies), protect=bool(request.protect),
                    timeouts={k: v for k, v in (("create", t.create), ("update", t.update), ("delete", t.delete)) if v},
                    replace_on_changes=list(request.replaceOnChanges), delete_before_replace=bool(request.deleteBeforeReplace),
                    retain_on_delete=bool(request.retainOnDelete))
            return super().RegisterResource(request)

    set_all_config(config)
    project = yaml.safe_load((main.parent / "Pulumi.yaml").read_text())["name"]
    monitor = RecordingMonitor(Mocks())
    mocks.set_mocks(Mocks(), project=project, stack=stack, preview=False, monitor=monitor)
    settings.SETTINGS.rpc_manager.clear()
    settings.SETTINGS.outputs.clear()
    outputs: dict[str, Any] = {}

    async def program() -> None:
        runpy.run_path(str(main), run_name="__main__")
        await wait_for_rpcs()
        stack_res = settings.get_root_resource()
        exported = dict(getattr(stack_res, "outputs", {}) or {})
        outputs.update(await pulumi.Output.from_input(exported).future() or {})

    # The program must finish inside this call; a hung mock run fails here instead of hanging the suite.
    _sync_await(asyncio.wait_for(run_pulumi_func(program), timeout=120))
    return list(records.values()), outputs


def run(stack: str, overrides: Mapping[str, str] | None = None, *, main: Path = ROOT / "__main__.py",
        preview_placeholders: bool = True) -> PreviewResult:
    """Run the program for `stack` under mocks. Raises PreviewError with the program's message on a refused config."""
    import pulumi

    config = stack_config(stack, overrides, main.parent)
    ns = yaml.safe_load((main.parent / "Pulumi.yaml").read_text())["name"]
    notes: list[str] = []
    if preview_placeholders and not config.get(f"{ns}:sshPublicKey"):
        config[f"{ns}:sshPublicKey"] = PREVIEW_SSH_KEY
        notes.append(f"{ns}:sshPublicKey is not set for this stack; the preview used a placeholder. "
                     f"`pulumi up` needs yours: pulumi config set {ns}:sshPublicKey \"$(cat ~/.ssh/id_ed25519.pub)\"")
    invokes: list[tuple[str, dict[str, Any]]] = []
    try:
        with _pickler_restored():
            resources, outputs = contextvars.Context().run(_run_in_fresh_context, main, stack, config, invokes)
    except pulumi.RunError as err:
        raise PreviewError(str(err)) from None
    return PreviewResult(stack=stack, config=config, resources=resources, outputs=outputs, notes=notes, invokes=invokes)
