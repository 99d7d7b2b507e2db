"""Offline preview: run the real Pulumi program under Pulumi's mock runtime and print what `pulumi up` would create.

    python -m tiered_ops.preview --stack prod [--json] [--set key=value ...]

No Azure credentials, no Pulumi CLI: the program (__main__.py) runs exactly as `pulumi up` would run
it, against mocks (tiered_ops/mockrun.py). Prints every resource (type, name, key properties) and
the sizing report. A refused setting prints its one-line message and exits 2 (EXIT_USAGE).

--json adds, like `pulumi preview --json`'s "steps", every resource's full inputs as structured JSON,
and "cloudInit": the custom data of every VM and scale set base64-decoded, with its #cloud-config
parsed, so a reviewer reads the boot script with jq, e.g.

    python -m tiered_ops.preview --stack prod --json | jq -r '.cloudInit[] | select(.type | endswith("VirtualMachineScaleSet"))
        | .cloudConfig.write_files[] | select(.path == "/usr/local/sbin/tiered-ckpt-bootstrap") | .content'

Values that only the mocks know (the AMLFS MGS address, subscription/tenant/identity ids, ARM ids)
are listed under "placeholders" with what they stand for; each cloudInit entry names the ones it holds.
"""
from __future__ import annotations

import argparse
import base64
import binascii
import hashlib
import json
import sys
from typing import Any

import yaml

from components.node import cloud_init as node_boot
from components.settings import sizing, vm_security
from tiered_ckpt.cli.output import print_error
from tiered_ckpt.errors import EXIT_OK, EXIT_USAGE
from tiered_ckpt.redact import redact_data
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


def _security_profile(profile: dict[str, Any] | None) -> dict[str, Any]:
    """A securityProfile as sent: securityType, and Secure Boot / vTPM where Trusted Launch sets them."""
    p = profile or {}
    uefi = p.get("uefiSettings") or {}
    return {"securityType": p.get("securityType") or "(unset: the API's default)",
            "secureBoot": bool(uefi.get("secureBootEnabled")), "vTPM": bool(uefi.get("vTpmEnabled"))}


VM_TYPES = ("azure-native:compute:VirtualMachine", "azure-native:compute:VirtualMachineScaleSet")


def vm_summary(result: mockrun.PreviewResult) -> list[dict[str, Any]]:
    """Per VM (the login VM, the scale set): size, the security profile as sent, and the boot path that goes
    with it (components/settings/vm_security.py: which Lustre client the image's boot loads, and why). `matches` is
    False when the sent profile differs from that decision: a reviewer must not miss it."""
    mode = str(result.config.get("tiered:trustedLaunch", "auto"))
    out: list[dict[str, Any]] = []
    for r in result.resources:
        if r.type not in VM_TYPES:
            continue
        scale_set = r.type.endswith("VirtualMachineScaleSet")
        size = str(_get(r.inputs, "sku", "name") if scale_set else _get(r.inputs, "hardwareProfile", "vmSize"))
        sent = _security_profile(_get(r.inputs, "virtualMachineProfile", "securityProfile") if scale_set else r.inputs.get("securityProfile"))
        decided = vm_security.vm_security(size, mode)
        out.append({
            "name": r.name, "kind": "scale set (ND nodes)" if scale_set else "login VM", "size": size, **sent,
            "lustreClient": decided.lustre_client, "why": decided.why,
            "matches": (sent["securityType"], sent["secureBoot"], sent["vTPM"]) == (decided.security_type, decided.secure_boot, decided.vtpm),
            # The Slurm packages this VM's boot installs, read from its custom data (components/node/cloud_init.py).
            "slurmPackages": _boot(_get(r.inputs, "virtualMachineProfile", "osProfile", "customData") if scale_set
                                   else _get(r.inputs, "osProfile", "customData")).get("slurm"),
        })
    return out


def _rule(x: dict[str, Any]) -> str:
    """An NSG rule as a reviewer checks it: name(I|O priority Allow|Deny source->destination:ports)."""
    ports = x.get("destinationPortRange") or ",".join(x.get("destinationPortRanges") or []) or "(none)"
    return (f"{x['name']}({x['direction'][0]}{_fmt(x['priority'])} {x.get('access')} {x.get('protocol')} "
            f"{x.get('sourceAddressPrefix')}->{x.get('destinationAddressPrefix')}:{ports})")


def _fmt(v: Any) -> str:
    # Mock inputs come back through protobuf, where every number is a float.
    return str(int(v)) if isinstance(v, float) and v.is_integer() else str(v)


def _elided(key: str, v: Any) -> dict[str, Any] | None:
    """Opaque base64 inputs, shown by what they are: the custom data (decoded under "cloudInit", where the
    sha256 of the same bytes is given) and a dynamic provider's serialized code. Long base64 runs in plan
    output would also hide a leaked key from the secret scans."""
    if key == "__provider":
        return {"elided": "serialized dynamic provider (Pulumi dynamic resource)", "chars": len(str(v))}
    if key == "customData" and isinstance(v, str):
        try:
            raw = base64.b64decode(v, validate=True)
        except binascii.Error:
            return None
        return {"elided": "base64 custom data, decoded under cloudInit", "bytes": len(raw),
                "sha256": hashlib.sha256(raw).hexdigest()}
    return None


def _jsonable(v: Any) -> Any:
    """Mock inputs as JSON: protobuf floats that are whole numbers back to ints, assets as their kind and path."""
    if isinstance(v, dict):
        out: dict[str, Any] = {}
        for k, x in v.items():
            short = _elided(str(k), x)
            out[str(k)] = short if short is not None else _jsonable(x)
        return out
    if isinstance(v, (list, tuple)):
        return [_jsonable(x) for x in v]
    if isinstance(v, float) and v.is_integer():
        return int(v)
    if v is None or isinstance(v, (str, int, float, bool)):
        return v
    if hasattr(v, "path"):          # pulumi.FileAsset / FileArchive
        return {"asset": type(v).__name__, "path": str(v.path)}
    return str(v)


def placeholders(result: mockrun.PreviewResult) -> list[dict[str, str]]:
    """Every value the mocks invent, labelled: a real `pulumi up` gets these from Azure."""
    out = [
        {"value": mockrun.MOCK_MGS, "label": "mgsAddress",
         "what": "AmlFilesystem clientInfo.mgsAddress: the file system's MGS address, known only once AMLFS exists"},
        {"value": mockrun.MOCK_SUBSCRIPTION, "label": "subscriptionId", "what": "the deploying subscription (getClientConfig)"},
        {"value": mockrun.MOCK_TENANT, "label": "tenantId", "what": "the deploying tenant (getClientConfig)"},
        {"value": mockrun.MOCK_RP_OBJECT_ID, "label": "rpPrincipalObjectId",
         "what": "object id of the HPC Cache Resource Provider service principal in your tenant"},
        {"value": mockrun.MOCK_PUBLIC_IP, "label": "publicIpAddress", "what": "a public IP address Azure allocates"},
        {"value": f"/subscriptions/{mockrun.MOCK_SUBSCRIPTION}/", "label": "resourceId",
         "what": "prefix of every ARM resource id: ids are invented by the mocks"},
    ]
    for r in result.resources:
        if r.type == "azure-native:managedidentity:UserAssignedIdentity":
            for k in ("clientId", "principalId"):
                if r.state.get(k):
                    out.append({"value": str(r.state[k]), "label": f"{r.name}.{k}", "what": f"the identity's {k}, assigned by Entra ID"})
    return out


def _custom_data(v: Any, path: str = "") -> list[tuple[str, str]]:
    found: list[tuple[str, str]] = []
    if isinstance(v, dict):
        for k, x in v.items():
            p = f"{path}.{k}" if path else k
            if k == "customData" and isinstance(x, str):
                found.append((p, x))
            else:
                found += _custom_data(x, p)
    elif isinstance(v, list):
        for i, x in enumerate(v):
            found += _custom_data(x, f"{path}[{i}]")
    return found


def _boot(b64: Any) -> dict[str, str]:
    """The boot's Slurm packages and Lustre client path, from a VM's custom data (components/node/cloud_init.py)."""
    try:
        return node_boot.boot_facts(base64.b64decode(str(b64 or ""), validate=True).decode())
    except (binascii.Error, UnicodeDecodeError, yaml.YAMLError):
        return {}


def cloud_init(result: mockrun.PreviewResult) -> list[dict[str, Any]]:
    """The decoded custom data of every VM and scale set."""
    marks = placeholders(result)
    out: list[dict[str, Any]] = []
    for r in result.resources:
        if not r.custom:
            continue
        for where, b64 in _custom_data(r.inputs):
            entry: dict[str, Any] = {"type": r.type, "name": r.name, "input": where}
            try:
                text = base64.b64decode(b64, validate=True).decode()
            except (binascii.Error, UnicodeDecodeError) as err:
                entry["error"] = f"not base64 UTF-8 text: {err}"
                out.append(entry)
                continue
            entry["bytes"] = len(text.encode())
            entry["sha256"] = hashlib.sha256(text.encode()).hexdigest()
            entry["text"] = text
            if text.startswith("#cloud-config"):
                entry["cloudConfig"] = yaml.safe_load(text)
            entry["placeholders"] = sorted({m["label"] for m in marks if m["value"] in text})
            out.append(entry)
    return out


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
        doc = redact_data({"ok": True, "stack": result.stack, "notes": result.notes, "outputs": _jsonable(result.outputs),
                           "resources": [{"type": r.type, "name": r.name, "parent": r.parent.rsplit("::", 1)[-1],
                                          "properties": key_properties(r)} for r in custom],
                           # Shaped like `pulumi preview --json` steps (op, urn, inputs); every step creates.
                           "steps": [{"op": "create", "urn": r.urn, "type": r.type, "name": r.name, "parent": r.parent,
                                      "custom": r.custom, "protect": r.protect, "retainOnDelete": r.retain_on_delete,
                                      "inputs": _jsonable(r.inputs)} for r in result.resources],
                           "vms": vm_summary(result), "placeholders": placeholders(result)})
        # The decoded custom data is not redacted: it is the same bytes the steps carry base64-encoded
        # (which no redaction pattern sees), it holds no secret by design (tests scan it), and the
        # redaction patterns would rewrite the script's own words ("bearer token", the curl header).
        doc["cloudInit"] = cloud_init(result)
        sys.stdout.write(json.dumps(doc, indent=2, sort_keys=True) + "\n")
        return EXIT_OK
    print(f"pulumi up --stack {result.stack} would create {len(custom)} resources "
          f"(compute side {'on' if result.outputs.get('computeEnabled') else 'OFF: archive only'}):")
    for comp in [r for r in result.resources if not r.custom]:
        print(f"\n{comp.type}  {comp.name}")
        for r in custom:
            if r.parent == comp.urn:
                print(f"  + {r.type.removeprefix('azure-native:'):<40} {r.name:<40} {key_properties(r)}")
    vms = vm_summary(result)
    if vms:
        print("\nper VM (security profile as sent; boot path that goes with it):")
        for v in vms:
            flag = "" if v["matches"] else "  MISMATCH with components/settings/vm_security.py"
            print(f"  {v['name']:<22} {v['kind']:<20} {v['size']:<28} securityType={v['securityType']}  "
                  f"secureBoot={'on' if v['secureBoot'] else 'off'}  vTPM={'on' if v['vTPM'] else 'off'}  "
                  f"lustreClient={v['lustreClient']}{flag}")
            if v["slurmPackages"]:
                print(f"  {'':<22} slurm packages: {v['slurmPackages']}")
            print(f"  {'':<22} why: {v['why']}")
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
