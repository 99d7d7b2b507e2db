"""Stack settings: one typed, validated object built from stack config before any resource exists.

Pure Python (no Pulumi, no cloud). `SCHEMA` is the list of every `tiered:` config key with its type,
default and description; Pulumi.yaml declares the same keys (a test keeps the two identical).
Every problem is a SettingsError whose message names the key, the value and the fix.
"""
from __future__ import annotations

import ipaddress
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from . import subnets

NAMESPACE = "tiered"


class SettingsError(Exception):
    """A stack setting is invalid. `str(err)` is the whole message shown to the user."""


@dataclass(frozen=True)
class Sku:
    name: str
    mbps_per_tib: int
    min_tib: int
    step_tib: int
    default_max_tib: int


# AZURE_FACTS.md: the four AMLFS SKUs. Capacity is rounded up by the service, so we demand exact steps.
SKUS: dict[str, Sku] = {
    s.name: s
    for s in (
        Sku("AMLFS-Durable-Premium-40", 40, 48, 48, 768),
        Sku("AMLFS-Durable-Premium-125", 125, 16, 16, 128),
        Sku("AMLFS-Durable-Premium-250", 250, 8, 8, 128),
        Sku("AMLFS-Durable-Premium-500", 500, 4, 4, 128),
    )
}

# Per-node Ethernet of ND sizes (Lustre runs over Ethernet, `<mgs>@tcp`, not InfiniBand).
ND_ETHERNET_GBITS: dict[str, int] = {
    "Standard_ND96isr_H100_v5": 80,
    "Standard_ND96isr_H200_v5": 80,
    "Standard_ND96amsr_A100_v4": 24,
    "Standard_ND96asr_v4": 24,
}

DAYS = ("Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday")
SQUASH_MODES = ("None", "RootOnly", "All")
RETENTION_ACTIONS = ("delete", "release")
STORAGE_SKUS = ("Standard_LRS", "Standard_GRS", "Standard_RAGRS", "Standard_ZRS", "Standard_GZRS", "Standard_RAGZRS")

# Patterns from the ARM API specs (AZURE_FACTS.md for AMLFS; compute naming rules for the scale set).
AMLFS_NAME = re.compile(r"^[0-9a-zA-Z][-0-9a-zA-Z_]{0,78}[0-9a-zA-Z]$")
TIME_OF_DAY = re.compile(r"^([0-9]|0[0-9]|1[0-9]|2[0-3]):[0-5][0-9]$")
NAME_PREFIX = re.compile(r"^[a-z][a-z0-9]{1,9}$")
GO_DURATION = re.compile(r"^(\d+h)?(\d+m)?(\d+s)?$")
SSH_KEY = re.compile(r"^(ssh-ed25519|ssh-rsa|ecdsa-sha2-nistp(256|384|521)|sk-ssh-ed25519@openssh\.com) AAAA[0-9A-Za-z+/=]+( .*)?$")
GUID = re.compile(r"^[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}$")
MODEL = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")


@dataclass(frozen=True)
class Key:
    name: str
    type: str          # Pulumi project config type: string | integer | boolean
    default: Any
    description: str


SCHEMA: tuple[Key, ...] = (
    Key("computeEnabled", "boolean", True, "Deploy the compute side (network, AMLFS, auto-export, GPU cluster). false keeps only the core storage layer (archive) managed, between training campaigns."),
    Key("location", "string", "eastus", "Azure region for every resource."),
    Key("zone", "string", "1", "Availability zone of the file system; the GPU nodes are placed in the same zone."),
    Key("namePrefix", "string", "tckpt", "Prefix of resource names: 2-10 lowercase letters and digits, starting with a letter."),
    Key("sku", "string", "AMLFS-Durable-Premium-500", "AMLFS SKU: AMLFS-Durable-Premium-40, -125, -250 or -500 (MB/s per TiB)."),
    Key("capacityTiB", "integer", 4, "AMLFS capacity in TiB; a multiple of the SKU's step, at least its minimum."),
    Key("allowAboveDefaultMax", "boolean", False, "Allow a capacity above the SKU's default per-subscription maximum (after support raised your quota)."),
    Key("maintenanceDay", "string", "Sunday", "AMLFS weekly maintenance window day (Monday..Sunday)."),
    Key("maintenanceTimeUtc", "string", "02:00", "AMLFS maintenance window start, HH:MM UTC."),
    Key("rootSquash", "string", "None", "AMLFS root squash mode: None, RootOnly or All."),
    Key("rootSquashTrustedNids", "string", "", "With RootOnly/All: Lustre NID list exempt from squashing, e.g. 10.42.4.[4-254]@tcp (the GPU nodes, so the toolkit's root service works)."),
    Key("vnetCidr", "string", "10.42.0.0/16", "Address space of the virtual network."),
    Key("amlfsSubnetCidr", "string", "10.42.0.0/24", "AMLFS subnet; must be at least the size Microsoft recommends for the capacity."),
    Key("computeSubnetCidr", "string", "10.42.4.0/22", "GPU node subnet."),
    Key("sshSourcePrefix", "string", "VirtualNetwork", "Only source allowed to SSH to the nodes: a CIDR or a service tag (VirtualNetwork = a jump host or Bastion in the VNet)."),
    Key("sshPublicKey", "string", "", "OpenSSH public key of the nodes' admin user (password login is disabled)."),
    Key("adminUsername", "string", "azureuser", "Admin user on the GPU nodes."),
    Key("vmSize", "string", "Standard_ND96isr_H100_v5", "GPU node size; must be an ND-series size."),
    Key("nodeCount", "integer", 1, "Number of GPU nodes."),
    Key("nodeEthernetGbps", "integer", 0, "Per-node Ethernet in Gbit/s for the sizing model; 0 = known value for the VM size."),
    Key("storageSku", "string", "Standard_LRS", "Storage account redundancy (Standard_*; archive tiering needs LRS/GRS/RA-GRS)."),
    Key("checkpointPrefix", "string", "/checkpoints", "Absolute Lustre path of the checkpoint root under /lustrefs; also the blob prefix exported and imported."),
    Key("modelName", "string", "default", "Model directory under the checkpoint root (the toolkit's `model`)."),
    Key("checkpointSizeGiB", "integer", 912, "Size of one checkpoint in GiB (sizing model)."),
    Key("checkpointIntervalSeconds", "integer", 1800, "Seconds between checkpoints (sizing model, archive keep-up check)."),
    Key("allowArchiveBacklog", "boolean", False, "Accept a checkpoint interval shorter than the archive time (the export backlog then grows)."),
    Key("dataMoverGBps", "string", "7.5", "Lustre-to-Blob export rate in GB/s (7.5 = the account's default ingress)."),
    Key("coolAfterDays", "integer", 30, "Lifecycle: move archived checkpoints to the cool tier after N days (0 = never)."),
    Key("coldAfterDays", "integer", 90, "Lifecycle: move them to the cold tier after N days (0 = never)."),
    Key("deleteAfterDays", "integer", 365, "Lifecycle: delete them from Blob after N days (0 = never)."),
    Key("softDeleteDays", "integer", 14, "Blob soft delete retention, 1-365 days."),
    Key("retentionKeepLast", "integer", 3, "Node retention: keep the newest N committed checkpoints on Lustre."),
    Key("retentionKeepEverySteps", "integer", 0, "Node retention: also keep every checkpoint whose step is a multiple of K (0 = off)."),
    Key("retentionMinKeep", "integer", 2, "Node retention: never go below N committed checkpoints on Lustre."),
    Key("retentionAction", "string", "release", "Node retention action for archived checkpoints: release (keep namespace, free data) or delete."),
    Key("retentionSchedule", "string", "*:0/15", "systemd OnCalendar schedule of the retention timer."),
    Key("rpPrincipalObjectId", "string", "", "Object ID of the HPC Cache Resource Provider service principal; empty = look it up by its appId."),
    Key("roleWaitDuration", "string", "5m", "Wait between the storage role grants and the file system (role propagation), e.g. 5m, 90s."),
    Key("blobJobWaitMinutes", "integer", 240, "How long `pulumi up` waits for the creation-time import to finish before creating auto-export."),
)

SCHEMA_BY_NAME = {k.name: k for k in SCHEMA}


@dataclass(frozen=True)
class Settings:
    stack: str
    compute_enabled: bool
    location: str
    zone: str
    name_prefix: str
    sku: Sku
    capacity_tib: int
    allow_above_default_max: bool
    maintenance_day: str
    maintenance_time_utc: str
    root_squash: str
    root_squash_trusted_nids: str
    vnet_cidr: str
    amlfs_subnet_cidr: str
    compute_subnet_cidr: str
    ssh_source_prefix: str
    ssh_public_key: str
    admin_username: str
    vm_size: str
    node_count: int
    node_ethernet_gbps: int
    storage_sku: str
    checkpoint_prefix: str
    model_name: str
    checkpoint_size_gib: int
    checkpoint_interval_seconds: int
    allow_archive_backlog: bool
    data_mover_gbps: float
    cool_after_days: int
    cold_after_days: int
    delete_after_days: int
    soft_delete_days: int
    retention_keep_last: int
    retention_keep_every_steps: int
    retention_min_keep: int
    retention_action: str
    retention_schedule: str
    rp_principal_object_id: str
    role_wait_duration: str
    blob_job_wait_minutes: int

    @property
    def base_name(self) -> str:
        """`<prefix>-<stack>`: the stem of every resource name."""
        return f"{self.name_prefix}-{self.stack}"

    @property
    def amlfs_name(self) -> str:
        return f"{self.base_name}-amlfs"

    @property
    def autoexport_job_name(self) -> str:
        return f"{self.base_name}-autoexport"

    @property
    def blob_prefix(self) -> str:
        """The checkpoint prefix as blob names see it: AMLFS exports /lustrefs/<p> to blob <p>."""
        return self.checkpoint_prefix.strip("/")

    @property
    def lustre_root(self) -> str:
        return "/lustrefs/" + self.blob_prefix


def _k(name: str) -> str:
    return f"{NAMESPACE}:{name}"


def _fail(name: str, value: Any, problem: str, fix: str) -> SettingsError:
    return SettingsError(f"{_k(name)}: {value!r} {problem}; {fix}")


def _coerce(key: Key, value: Any) -> Any:
    """Config values arrive as strings (pulumi.Config) or YAML scalars (stack files)."""
    if key.type == "boolean":
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.strip().lower() in ("true", "false"):
            return value.strip().lower() == "true"
        raise _fail(key.name, value, "is not a boolean", f"set it to true or false: pulumi config set {_k(key.name)} true")
    if key.type == "integer":
        if isinstance(value, bool):
            raise _fail(key.name, value, "is not a whole number", f"set a number: pulumi config set {_k(key.name)} {key.default}")
        if isinstance(value, int):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        if isinstance(value, str) and re.fullmatch(r"\s*-?\d+\s*", value):
            return int(value)
        raise _fail(key.name, value, "is not a whole number", f"set a number: pulumi config set {_k(key.name)} {key.default}")
    return "" if value is None else str(value)


def _network(name: str, value: str) -> ipaddress.IPv4Network:
    try:
        net = ipaddress.ip_network(value, strict=True)
    except ValueError:
        raise _fail(name, value, "is not an IPv4 network in CIDR form", "use e.g. 10.42.0.0/24 with the host bits zero") from None
    if not isinstance(net, ipaddress.IPv4Network):
        raise _fail(name, value, "is IPv6; AMLFS accepts IPv4 only", "use an IPv4 range such as 10.42.0.0/24")
    return net


def _nearest_capacities(sku: Sku, tib: int) -> str:
    lower = max(sku.min_tib, (tib // sku.step_tib) * sku.step_tib)
    upper = max(sku.min_tib, -(-tib // sku.step_tib) * sku.step_tib)
    return f"{lower}" if lower == upper else f"{lower} or {upper}"


def _check_storage(s: dict[str, Any]) -> None:
    if s["storageSku"] not in STORAGE_SKUS:
        raise _fail("storageSku", s["storageSku"], "is not a supported redundancy", f"use one of {', '.join(STORAGE_SKUS)}")
    if not (1 <= s["softDeleteDays"] <= 365):
        raise _fail("softDeleteDays", s["softDeleteDays"], "is outside 1-365", "set the blob soft delete retention in days, e.g. 14")
    for name in ("coolAfterDays", "coldAfterDays", "deleteAfterDays"):
        if s[name] < 0:
            raise _fail(name, s[name], "is negative", "use a number of days, or 0 for never")
    steps = [(n, s[n]) for n in ("coolAfterDays", "coldAfterDays", "deleteAfterDays") if s[n] > 0]
    for (a, da), (b, db) in zip(steps, steps[1:], strict=False):
        if db <= da:
            raise _fail(b, db, f"is not after {_k(a)} ({da})", f"make {_k(b)} larger than {da}, or 0 for never")
    prefix = s["checkpointPrefix"]
    if not prefix.startswith("/"):
        raise _fail("checkpointPrefix", prefix, "is not an absolute path", "start it with '/', e.g. /checkpoints")
    if prefix.strip("/") == "" or not re.fullmatch(r"/[A-Za-z0-9._/-]+", prefix) or "//" in prefix or ".." in prefix.split("/"):
        raise _fail("checkpointPrefix", prefix, "is not a usable checkpoint directory", "use a path below the mount such as /checkpoints (letters, digits, . _ - /)")
    if not MODEL.fullmatch(s["modelName"]):
        raise _fail("modelName", s["modelName"], "is not a valid model directory name", "use letters, digits, '.', '_' or '-'")


def _check_amlfs(s: dict[str, Any], stack: str) -> Sku:
    sku = SKUS.get(s["sku"])
    if sku is None:
        raise _fail("sku", s["sku"], "is not an AMLFS SKU", f"use one of {', '.join(SKUS)}")
    tib = s["capacityTiB"]
    if tib < sku.min_tib:
        raise _fail("capacityTiB", tib, f"is below the minimum of {sku.name} ({sku.min_tib} TiB)", f"use {sku.min_tib} or more, in steps of {sku.step_tib}")
    if tib % sku.step_tib:
        raise _fail("capacityTiB", tib, f"is not a multiple of {sku.name}'s step ({sku.step_tib} TiB)", f"use the nearest valid size: {_nearest_capacities(sku, tib)}")
    if tib > sku.default_max_tib and not s["allowAboveDefaultMax"]:
        raise _fail("capacityTiB", tib, f"is above {sku.name}'s default maximum ({sku.default_max_tib} TiB per subscription)",
                    f"ask Azure support to raise the quota, then set {_k('allowAboveDefaultMax')} true; or use {sku.default_max_tib} or less")
    if s["maintenanceDay"] not in DAYS:
        raise _fail("maintenanceDay", s["maintenanceDay"], "is not a day of the week", f"use one of {', '.join(DAYS)}")
    if not TIME_OF_DAY.fullmatch(s["maintenanceTimeUtc"]):
        raise _fail("maintenanceTimeUtc", s["maintenanceTimeUtc"], "is not a time of day", "use HH:MM in UTC, 24-hour clock, e.g. 02:00")
    if s["rootSquash"] not in SQUASH_MODES:
        raise _fail("rootSquash", s["rootSquash"], "is not a root squash mode", f"use one of {', '.join(SQUASH_MODES)}")
    for name in (f"{s['namePrefix']}-{stack}-amlfs", f"{s['namePrefix']}-{stack}-autoexport"):
        if not AMLFS_NAME.fullmatch(name):
            raise SettingsError(f"stack name {stack!r}: the derived name {name!r} does not match the API pattern {AMLFS_NAME.pattern}; "
                                "use a stack name of letters, digits and '-' (at most 60 characters)")
    return sku


def _check_network(s: dict[str, Any], capacity_tib: int) -> None:
    vnet = _network("vnetCidr", s["vnetCidr"])
    amlfs = _network("amlfsSubnetCidr", s["amlfsSubnetCidr"])
    compute = _network("computeSubnetCidr", s["computeSubnetCidr"])
    for name, net in (("amlfsSubnetCidr", amlfs), ("computeSubnetCidr", compute)):
        if not net.subnet_of(vnet):
            raise _fail(name, str(net), f"is not inside {_k('vnetCidr')} ({vnet})", f"pick a range inside {vnet}")
    if amlfs.overlaps(compute):
        raise _fail("computeSubnetCidr", str(compute), f"overlaps {_k('amlfsSubnetCidr')} ({amlfs})", "give the two subnets disjoint ranges; AMLFS needs a subnet of its own")
    need = subnets.required_prefix(capacity_tib)
    if amlfs.prefixlen > need:
        raise _fail("amlfsSubnetCidr", str(amlfs), f"is too small for {capacity_tib} TiB (Microsoft recommends /{need} or larger)",
                    f"use a /{need} or larger, e.g. {subnets.example(vnet, need, avoid=compute)}")
    src = s["sshSourcePrefix"]
    if not src:
        raise _fail("sshSourcePrefix", src, "is empty", "set the CIDR (or service tag, e.g. VirtualNetwork) SSH may come from")
    if re.fullmatch(r"[0-9./]+", src):
        try:
            ipaddress.ip_network(src, strict=False)
        except ValueError:
            raise _fail("sshSourcePrefix", src, "is not an IP range", "use a CIDR such as 203.0.113.0/24 or a service tag such as VirtualNetwork") from None
        if src in ("0.0.0.0/0", "0.0.0.0"):
            raise _fail("sshSourcePrefix", src, "opens SSH to the whole internet", "use your admin network's CIDR or VirtualNetwork")
    elif src in ("*", "Internet", "Any"):
        raise _fail("sshSourcePrefix", src, "opens SSH to the whole internet", "use your admin network's CIDR or VirtualNetwork")
    elif not re.fullmatch(r"[A-Za-z][A-Za-z0-9.]*", src):
        raise _fail("sshSourcePrefix", src, "is neither a CIDR nor a service tag", "use e.g. 203.0.113.0/24 or VirtualNetwork")


def _check_cluster(s: dict[str, Any]) -> None:
    size = s["vmSize"]
    if not re.fullmatch(r"Standard_ND\w+", size):
        raise _fail("vmSize", size, "is not an ND-series size (InfiniBand GPU nodes)", f"use an ND size such as {', '.join(ND_ETHERNET_GBITS)}")
    if s["nodeCount"] < 1:
        raise _fail("nodeCount", s["nodeCount"], "is below 1", f"deploy at least one node, or set {_k('computeEnabled')} false to remove the compute side")
    if s["nodeCount"] > 100:
        raise _fail("nodeCount", s["nodeCount"], "exceeds 100 nodes, the limit of one InfiniBand placement group", "use at most 100 nodes per stack")
    if s["nodeEthernetGbps"] < 0:
        raise _fail("nodeEthernetGbps", s["nodeEthernetGbps"], "is negative", "use 0 (known value for the VM size) or the Gbit/s of the size's Ethernet")
    if s["nodeEthernetGbps"] == 0 and size not in ND_ETHERNET_GBITS:
        raise _fail("nodeEthernetGbps", 0, f"leaves the Ethernet bandwidth of {size} unknown",
                    f"set {_k('nodeEthernetGbps')} to its Gbit/s from the Azure size page")
    key = s["sshPublicKey"].strip()
    if not SSH_KEY.fullmatch(key):
        shown = key[:24] + "..." if len(key) > 24 else key
        if "PRIVATE KEY" in key:
            raise SettingsError(f"{_k('sshPublicKey')}: holds a private key; set the PUBLIC key: pulumi config set {_k('sshPublicKey')} \"$(cat ~/.ssh/id_ed25519.pub)\"")
        raise _fail("sshPublicKey", shown, "is not an OpenSSH public key", f"pulumi config set {_k('sshPublicKey')} \"$(cat ~/.ssh/id_ed25519.pub)\"")
    if not re.fullmatch(r"[a-z_][a-z0-9_-]{0,31}", s["adminUsername"]) or s["adminUsername"] in ("root", "admin"):
        raise _fail("adminUsername", s["adminUsername"], "is not an allowed Linux user name", "use lowercase letters/digits, not root or admin, e.g. azureuser")


def _check_toolkit(s: dict[str, Any]) -> None:
    for name, minimum in (("retentionKeepLast", 1), ("retentionMinKeep", 1), ("retentionKeepEverySteps", 0)):
        if s[name] < minimum:
            raise _fail(name, s[name], f"is below {minimum}", f"set a whole number >= {minimum}")
    if s["retentionAction"] not in RETENTION_ACTIONS:
        raise _fail("retentionAction", s["retentionAction"], "is not a retention action", "use release or delete")
    if not re.fullmatch(r"[0-9A-Za-z*:/,. -]+", s["retentionSchedule"]):
        raise _fail("retentionSchedule", s["retentionSchedule"], "is not a systemd OnCalendar expression", "use e.g. *:0/15 or hourly")


def _check_common(s: dict[str, Any]) -> float:
    if not NAME_PREFIX.fullmatch(s["namePrefix"]):
        raise _fail("namePrefix", s["namePrefix"], "does not match ^[a-z][a-z0-9]{1,9}$ (it is part of the storage account name)",
                    "use 2-10 lowercase letters and digits, starting with a letter")
    if not re.fullmatch(r"[a-z0-9]+", s["location"]):
        raise _fail("location", s["location"], "is not an Azure region name", "use the short name, e.g. eastus, southcentralus")
    if s["zone"] not in ("1", "2", "3"):
        raise _fail("zone", s["zone"], "is not an availability zone", "use 1, 2 or 3 (AMLFS lives in one zone; the nodes follow it)")
    for name in ("checkpointSizeGiB", "checkpointIntervalSeconds", "blobJobWaitMinutes"):
        if s[name] < 1:
            raise _fail(name, s[name], "is below 1", "set a positive whole number")
    try:
        gbps = float(s["dataMoverGBps"])
    except ValueError:
        gbps = -1.0
    if not gbps > 0:
        raise _fail("dataMoverGBps", s["dataMoverGBps"], "is not a positive rate", "use GB/s, e.g. 7.5")
    dur = s["roleWaitDuration"]
    if not dur or not GO_DURATION.fullmatch(dur):
        raise _fail("roleWaitDuration", dur, "is not a duration", "use e.g. 5m, 90s or 1m30s (role grants take up to 5 minutes to apply)")
    oid = s["rpPrincipalObjectId"]
    if oid and not GUID.fullmatch(oid):
        raise _fail("rpPrincipalObjectId", oid, "is not an object ID (GUID)",
                    "leave it empty to look it up, or use: az ad sp show --id 4392ab71-2ce2-4b0d-8770-b352745c73f5 --query id -o tsv")
    return gbps


def load(raw: Mapping[str, Any], stack: str) -> Settings:
    """Build validated Settings from config values keyed by bare or `tiered:`-qualified names.

    Unset keys take the SCHEMA default. Raises SettingsError naming key, value and fix.
    """
    values: dict[str, Any] = {}
    for full, value in raw.items():
        name = full.split(":", 1)[1] if full.startswith(NAMESPACE + ":") else full
        if ":" in name:
            continue  # provider settings such as azure-native:location are not ours
        if name not in SCHEMA_BY_NAME:
            raise SettingsError(f"{_k(name)}: unknown setting; check the spelling against Pulumi.yaml (known: {', '.join(sorted(SCHEMA_BY_NAME))})")
        values[name] = value
    s: dict[str, Any] = {}
    for key in SCHEMA:
        s[key.name] = _coerce(key, values.get(key.name, key.default))
    if not re.fullmatch(r"[A-Za-z0-9_.-]+", stack):
        raise SettingsError(f"stack name {stack!r}: must be letters, digits, '-', '_' or '.'; create a stack with such a name")

    gbps = _check_common(s)
    _check_storage(s)
    _check_toolkit(s)
    sku = _check_amlfs(s, stack)
    if s["computeEnabled"]:
        _check_network(s, s["capacityTiB"])
        _check_cluster(s)
    settings = Settings(
        stack=stack,
        compute_enabled=s["computeEnabled"],
        location=s["location"],
        zone=s["zone"],
        name_prefix=s["namePrefix"],
        sku=sku,
        capacity_tib=s["capacityTiB"],
        allow_above_default_max=s["allowAboveDefaultMax"],
        maintenance_day=s["maintenanceDay"],
        maintenance_time_utc=s["maintenanceTimeUtc"],
        root_squash=s["rootSquash"],
        root_squash_trusted_nids=s["rootSquashTrustedNids"],
        vnet_cidr=s["vnetCidr"],
        amlfs_subnet_cidr=s["amlfsSubnetCidr"],
        compute_subnet_cidr=s["computeSubnetCidr"],
        ssh_source_prefix=s["sshSourcePrefix"],
        ssh_public_key=s["sshPublicKey"].strip(),
        admin_username=s["adminUsername"],
        vm_size=s["vmSize"],
        node_count=s["nodeCount"],
        node_ethernet_gbps=s["nodeEthernetGbps"] or ND_ETHERNET_GBITS.get(s["vmSize"], 0),
        storage_sku=s["storageSku"],
        checkpoint_prefix=s["checkpointPrefix"].rstrip("/"),
        model_name=s["modelName"],
        checkpoint_size_gib=s["checkpointSizeGiB"],
        checkpoint_interval_seconds=s["checkpointIntervalSeconds"],
        allow_archive_backlog=s["allowArchiveBacklog"],
        data_mover_gbps=gbps,
        cool_after_days=s["coolAfterDays"],
        cold_after_days=s["coldAfterDays"],
        delete_after_days=s["deleteAfterDays"],
        soft_delete_days=s["softDeleteDays"],
        retention_keep_last=s["retentionKeepLast"],
        retention_keep_every_steps=s["retentionKeepEverySteps"],
        retention_min_keep=s["retentionMinKeep"],
        retention_action=s["retentionAction"],
        retention_schedule=s["retentionSchedule"],
        rp_principal_object_id=s["rpPrincipalObjectId"],
        role_wait_duration=s["roleWaitDuration"],
        blob_job_wait_minutes=s["blobJobWaitMinutes"],
    )
    if settings.compute_enabled:
        from . import sizing  # local import: sizing depends on Settings

        sizing.check(settings)
    return settings
