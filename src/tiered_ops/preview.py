"""Offline preview: run the real Pulumi program under Pulumi's mock runtime and print what `pulumi up` would create.

    python -m tiered_ops.preview --stack prod [--json] [--set key=value ...]

No Azure credentials, no Pulumi CLI: the program (__main__.py) runs exactly as `pulumi up` would run
it, against mocks (tiered_ops/mockrun.py). Prints every resource (type, name, key properties) and
the sizing report. A refused setting prints its one-line message and exits 2 (EXIT_USAGE).
"""
from __future__ import annotations

import argparse
import sys
from typing import Any

from components import sizing
from tiered_ckpt.cli.output import print_error, print_json
from tiered_ckpt.errors import EXIT_OK, EXIT_USAGE
from tiered_ops import mockrun
from tiered_ops.mockrun import Res


def _get(d: Any, *path: str) -> Any:
    for k in path:
        if not isinstance(d, dict):
            return None
        d = d.get(k)
    return d


def _short_id(v: Any) -> str:
    return str(v).rsplit("/", 1)[-1] if isinstance(v, str) and v.startswith("/subscriptions/") else str(v)


def key_properties(r: Res) -> str:
    """The properties a reviewer checks for each resource type (security, size, wiring)."""
    i, t = r.inputs, r.type.split(":")[-1]
    parts: dict[str, Any] = {}
    if t == "ResourceGroup":
        parts = {"name": i.get("resourceGroupName"), "location": i.get("location"), "protect": r.protect}
    elif t == "StorageAccount":
        parts = {"name": i.get("accountName"), "sku": _get(i, "sku", "name"), "kind": i.get("kind"),
                 "httpsOnly": i.get("enableHttpsTrafficOnly"), "tls": i.get("minimumTlsVersion"),
                 "publicBlob": i.get("allowBlobPublicAccess"), "sharedKey": i.get("allowSharedKeyAccess"),
                 "network": _get(i, "networkRuleSet", "defaultAction") or "Allow",
                 "subnets": len(_get(i, "networkRuleSet", "virtualNetworkRules") or []), "protect": r.protect}
    elif t == "BlobContainer":
        parts = {"container": i.get("containerName"), "public": i.get("publicAccess"), "protect": r.protect}
    elif t == "BlobServiceProperties":
        parts = {"softDeleteDays": _get(i, "deleteRetentionPolicy", "days")}
    elif t == "ManagementPolicy":
        rule = (_get(i, "policy", "rules") or [{}])[0]
        acts = _get(rule, "definition", "actions", "baseBlob") or {}
        parts = {"prefix": ",".join(_get(rule, "definition", "filters", "prefixMatch") or []),
                 **{k: v.get("daysAfterModificationGreaterThan") for k, v in acts.items()}}
    elif t == "Blob":
        parts = {"blob": i.get("blobName"), "container": i.get("containerName")}
    elif t == "RoleAssignment":
        parts = {"role": _short_id(i.get("roleDefinitionId")), "principalType": i.get("principalType"),
                 "scope": "/".join(str(i.get("scope", "")).split("/")[-2:])}
    elif t == "RoleDefinition":
        parts = {"role": i.get("roleName"), "actions": len((i.get("permissions") or [{}])[0].get("actions", []))}
    elif t == "Sleep":
        parts = {"createDuration": i.get("createDuration")}
    elif t == "VirtualNetwork":
        parts = {"addressSpace": ",".join(_get(i, "addressSpace", "addressPrefixes") or [])}
    elif t == "Subnet":
        parts = {"cidr": i.get("addressPrefix"), "endpoints": ",".join(e.get("service", "") for e in i.get("serviceEndpoints") or []),
                 "nat": bool(i.get("natGateway")), "nsg": bool(i.get("networkSecurityGroup"))}
    elif t == "NetworkSecurityGroup":
        parts = {"rules": "; ".join(_rule(x) for x in i.get("securityRules") or [])}
    elif t in ("NatGateway", "PublicIPAddress"):
        parts = {"zones": ",".join(i.get("zones") or []), "sku": _get(i, "sku", "name")}
    elif t == "AmlFilesystem":
        parts = {"name": i.get("amlFilesystemName"), "sku": _get(i, "sku", "name"), "TiB": i.get("storageCapacityTiB"),
                 "zones": ",".join(i.get("zones") or []), "importPrefix": _get(i, "hsm", "settings", "importPrefix"),
                 "maintenance": f"{_get(i, 'maintenanceWindow', 'dayOfWeek')} {_get(i, 'maintenanceWindow', 'timeOfDayUTC')}",
                 "rootSquash": _get(i, "rootSquashSettings", "mode"), "timeouts": r.timeouts.get("create")}
    elif t == "AutoExportJob":
        parts = {"name": i.get("autoExportJobName"), "prefixes": ",".join(i.get("autoExportPrefixes") or []),
                 "adminStatus": i.get("adminStatus")}
    elif t == "UserAssignedIdentity":
        parts = {}
    elif t == "VirtualMachineScaleSet":
        vm = i.get("virtualMachineProfile") or {}
        nic = (_get(vm, "networkProfile", "networkInterfaceConfigurations") or [{}])[0]
        parts = {"size": _get(i, "sku", "name"), "count": _get(i, "sku", "capacity"), "zones": ",".join(i.get("zones") or []),
                 "singlePlacementGroup": i.get("singlePlacementGroup"), "faultDomains": i.get("platformFaultDomainCount"),
                 "overprovision": i.get("overprovision"), "acceleratedNetworking": nic.get("enableAcceleratedNetworking"),
                 "image": ":".join(str(_get(vm, "storageProfile", "imageReference", k)) for k in ("publisher", "offer", "sku")),
                 "passwordAuth": not _get(vm, "osProfile", "linuxConfiguration", "disablePasswordAuthentication"),
                 "publicIp": any("publicIPAddressConfiguration" in c for c in nic.get("ipConfigurations") or []),
                 "customDataB64": len(_get(vm, "osProfile", "customData") or "")}
    elif t == "VirtualMachine":
        linux = _get(i, "osProfile", "linuxConfiguration") or {}
        parts = {"size": _get(i, "hardwareProfile", "vmSize"), "zones": ",".join(i.get("zones") or []),
                 "image": ":".join(str(_get(i, "storageProfile", "imageReference", k)) for k in ("publisher", "offer", "sku")),
                 "identities": len(_get(i, "identity", "userAssignedIdentities") or []),
                 "passwordAuth": not linux.get("disablePasswordAuthentication"),
                 "customDataB64": len(_get(i, "osProfile", "customData") or "")}
    elif t == "NetworkInterface":
        ipc = (i.get("ipConfigurations") or [{}])[0]
        parts = {"privateIp": ipc.get("privateIPAddress"), "allocation": ipc.get("privateIPAllocationMethod"),
                 "publicIp": bool(ipc.get("publicIPAddress")), "acceleratedNetworking": i.get("enableAcceleratedNetworking")}
    elif t == "BastionHost":
        parts = {"name": i.get("bastionHostName"), "sku": _get(i, "sku", "name"), "nativeClient": i.get("enableTunneling")}
    elif t == "Vault":
        p = i.get("properties") or {}
        parts = {"rbac": p.get("enableRbacAuthorization"), "network": _get(p, "networkAcls", "defaultAction"),
                 "subnets": len(_get(p, "networkAcls", "virtualNetworkRules") or []), "softDeleteDays": p.get("softDeleteRetentionInDays")}
    elif r.type == mockrun.WAIT_TYPE:
        parts = {"waits for": "no import/archive job on " + str(i.get("filesystem")), "timeout_s": i.get("timeout_s")}
    return "  ".join(f"{k}={_fmt(v)}" for k, v in parts.items() if v not in (None, ""))


def _rule(x: dict[str, Any]) -> str:
    """An NSG rule as a reviewer checks it: name(I|O priority Allow|Deny source->destination:ports)."""
    ports = ",".join(x.get("destinationPortRanges") or [x.get("destinationPortRange") or "*"])
    return (f"{x['name']}({x['direction'][0]}{_fmt(x['priority'])} {x.get('access')} {x.get('protocol')} "
            f"{x.get('sourceAddressPrefix')}->{x.get('destinationAddressPrefix')}:{ports})")


def _fmt(v: Any) -> str:
    # Mock inputs come back through protobuf, where every number is a float.
    return str(int(v)) if isinstance(v, float) and v.is_integer() else str(v)


def parse_sets(items: list[str]) -> dict[str, str]:
    out: dict[str, str] = {}
    for item in items:
        if "=" not in item:
            raise mockrun.PreviewError(f"--set {item!r}: expected key=value, e.g. --set nodeCount=4")
        k, v = item.split("=", 1)
        out[k.strip()] = v
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--stack", required=True, help="stack name: stacks/Pulumi.<stack>.yaml")
    ap.add_argument("--json", action="store_true", help="machine-readable output")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a tiered: setting for this preview")
    args = ap.parse_args(argv)
    try:
        result = mockrun.run(args.stack, parse_sets(args.set))
    except mockrun.PreviewError as err:
        print_error(str(err), as_json=args.json, exit_code=EXIT_USAGE)
        return EXIT_USAGE
    z = result.outputs.get("sizing") or {}
    custom = [r for r in result.resources if r.custom]
    if args.json:
        print_json({"ok": True, "stack": result.stack, "notes": result.notes, "outputs": result.outputs,
                    "resources": [{"type": r.type, "name": r.name, "parent": r.parent.rsplit("::", 1)[-1],
                                   "properties": key_properties(r)} for r in custom]})
        return EXIT_OK
    print(f"pulumi up --stack {result.stack} would create {len(custom)} resources "
          f"(compute side {'on' if result.outputs.get('computeEnabled') else 'OFF: archive only'}):")
    for comp in [r for r in result.resources if not r.custom]:
        print(f"\n{comp.type}  {comp.name}")
        for r in custom:
            if r.parent == comp.urn:
                print(f"  + {r.type.removeprefix('azure-native:'):<40} {r.name:<40} {key_properties(r)}")
    o = result.outputs
    if o.get("sshCommand"):
        print(f"\nway in ({o.get('access')}): {o['sshCommand']}")
    if o.get("nodeBootstrapScript"):
        print(f"\nclusterMode none: stack output nodeBootstrapScript ({len(o['nodeBootstrapScript'])} bytes), "
              "run as root on each node of your cluster (see docs/deploy.md)")
    if z:
        print("\nsizing:")
        for label, value in sizing.report(sizing.Sizing(**z)):
            print(f"  {label:<28} {value}")
    for note in result.notes:
        print(f"\nnote: {note}")
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
