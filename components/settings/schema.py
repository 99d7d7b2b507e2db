"""Stack settings: one typed, validated object built from stack config before any resource exists.

Pure Python (no Pulumi, no cloud). `SCHEMA` is the list of every `tiered:` config key with its type,
default and description; Pulumi.yaml's config block is generated from it (`python -m components.settings
--pulumi-yaml`; a test fails when the file is stale).
Every problem is a SettingsError whose message names the key, the value and the fix.
"""
from __future__ import annotations

import ipaddress
import math
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field, fields
from typing import Any

from tiered_ckpt.config import RetentionConfig, section_problems
from tiered_ckpt.errors import UserError
from tiered_ckpt.lifecycle.archive_retention import JOURNAL_PREFIX

from . import oncalendar, sizing, subnets, vm_security
from .azure import (
    AMLFS_NAME,
    BASTION_MIN_PREFIX,
    LOGIN_VM_SIZES,
    MAX_NODES,
    ND_ETHERNET_GBITS,
    ND_RAM_GIB,
    NID,
    NON_PUBLIC,
    SKUS,
    SQUASH_MODES,
    STORAGE_SKUS,
    TIME_OF_DAY,
    Sku,
)

NAMESPACE = "tiered"


class SettingsError(UserError):
    """Stack settings are invalid (a user error, exit code 2). `str(err)` is the whole message shown to the user: one line per problem,
    each naming the key, the value and the fix; `problems` holds the lines one by one."""

    def __init__(self, message: str, problems: tuple[str, ...] = ()) -> None:
        super().__init__(message)
        self.problems = problems or (message,)

    @classmethod
    def of(cls, errors: list[SettingsError]) -> SettingsError:
        lines = tuple(line for e in errors for line in e.problems)
        return cls("\n".join(lines), lines)


# The memory tier lives in /dev/shm, a tmpfs the kernel sizes at half the RAM by default (tmpfs(5):
# "size ... The default is half of your physical RAM"); the other half is the training processes'.
MEMORY_TIER_RAM_FRACTION = sizing.MEMORY_RAM_FRACTION

DAYS = ("Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday")
_RETENTION = RetentionConfig()
# stack key -> the node config's retention setting it becomes
RETENTION_KEYS = {"retentionKeepLast": "keep_last", "retentionKeepEverySteps": "keep_every_steps",
                  "retentionMinKeep": "min_keep", "retentionAction": "action"}

NAME_PREFIX = re.compile(r"^[a-z][a-z0-9]{1,9}$")
GO_DURATION = re.compile(r"^(\d+h)?(\d+m)?(\d+s)?$")
SSH_KEY = re.compile(r"^(ssh-ed25519|ssh-rsa|ecdsa-sha2-nistp(256|384|521)|sk-ssh-ed25519@openssh\.com) AAAA[0-9A-Za-z+/=]+( .*)?$")
GUID = re.compile(r"^[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}$")
MODEL = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")

CLUSTER_MODES = ("slurm", "none")
ACCESS_MODES = ("bastion", "public-ip", "none")
# Sources that would open SSH to every address on the internet.
OPEN_PREFIXES = ("0.0.0.0/0", "0.0.0.0", "::/0")
# Trusted Launch per size and what each VM gets: components/settings/vm_security.py (sizes with their source).
TRUSTED_LAUNCH_MODES = vm_security.MODES
# The toolkit's own service account/group (components/node/cloud_init.py creates it): never a training group.
SERVICE_GROUP = "tiered-ckpt"
RESERVED_NAMES = ("root", "admin", "slurm", "munge", SERVICE_GROUP)


@dataclass(frozen=True)
class Key:
    """One `tiered:` stack setting; Pulumi.yaml's config block is generated from these (pulumi_yaml)."""

    name: str          # the stack config key (camelCase, under the `tiered:` namespace)
    field: str         # the Settings attribute
    type: str          # Pulumi project config type: string | integer | boolean
    default: Any
    description: str


_KEY = "tiered.key"


def key(name: str, default: Any, description: str) -> Any:
    """Declare a Settings field as the stack setting `name` (type from the field's annotation)."""
    return field(metadata={_KEY: (name, default, description)})


# Pulumi config types of the Settings annotations; everything else (Sku, float) arrives as a string.
_PULUMI_TYPES = {"bool": "boolean", "int": "integer"}


@dataclass(frozen=True)
class Settings:
    """Validated stack settings. Each field below IS the declaration of its stack key: name, default
    and description; `SCHEMA` is derived from these fields, so adding a key is one field here plus
    its entry in Pulumi.yaml."""

    stack: str
    compute_enabled: bool = key("computeEnabled", True,
        "Deploy the compute side (network, AMLFS, auto-export, GPU cluster). false keeps only the core storage layer (archive) managed, between training campaigns.")
    location: str = key("location", "eastus",
        "Azure region for every resource.")
    zone: str = key("zone", "1",
        "Availability zone of the file system; the GPU nodes are placed in the same zone.")
    name_prefix: str = key("namePrefix", "tckpt",
        "Prefix of resource names: 2-10 lowercase letters and digits, starting with a letter.")
    sku: Sku = key("sku", "AMLFS-Durable-Premium-500",
        "AMLFS SKU: AMLFS-Durable-Premium-40, -125, -250 or -500 (MB/s per TiB).")
    capacity_tib: int = key("capacityTiB", 4,
        "AMLFS capacity in TiB; a multiple of the SKU's step, at least its minimum.")
    allow_above_default_max: bool = key("allowAboveDefaultMax", False,
        "Allow a capacity above the SKU's default per-subscription maximum (after support raised your quota).")
    maintenance_day: str = key("maintenanceDay", "Sunday",
        "AMLFS weekly maintenance window day (Monday..Sunday).")
    maintenance_time_utc: str = key("maintenanceTimeUtc", "02:00",
        "AMLFS maintenance window start, HH:MM UTC.")
    root_squash: str = key("rootSquash", "RootOnly",
        "AMLFS root squash mode: RootOnly (root on untrusted hosts becomes nobody), All or None.")
    root_squash_trusted_nids: str = key("rootSquashTrustedNids", "",
        "With RootOnly/All: Lustre NIDs that keep root, ';'-separated, e.g. 10.42.4.[4-254]@tcp; empty = every address of computeSubnetCidr (login VM and GPU nodes).")
    vnet_cidr: str = key("vnetCidr", "10.42.0.0/16",
        "Address space of the virtual network.")
    amlfs_subnet_cidr: str = key("amlfsSubnetCidr", "10.42.0.0/24",
        "AMLFS subnet; must be at least the size Microsoft recommends for the capacity.")
    compute_subnet_cidr: str = key("computeSubnetCidr", "10.42.4.0/22",
        "GPU node subnet.")
    ssh_source_prefix: str = key("sshSourcePrefix", "VirtualNetwork",
        "Source allowed to SSH to the cluster besides Bastion: a CIDR or a service tag (VirtualNetwork = VPN/peered networks); access public-ip needs your public CIDR.")
    ssh_public_key: str = key("sshPublicKey", "",
        "OpenSSH public key of the nodes' admin user (password login is disabled).")
    admin_username: str = key("adminUsername", "azureuser",
        "Admin user on the login VM and the GPU nodes.")
    cluster_mode: str = key("clusterMode", "slurm",
        "slurm: a login/controller VM (slurmctld) and slurmd on every ND node; none: bring your own cluster (no VMs; storage, AMLFS, auto-export and a node bootstrap script).")
    access: str = key("access", "bastion",
        "Way in to the login VM: bastion (Azure Bastion Standard, native-client SSH), public-ip (login VM only, SSH from sshSourcePrefix) or none (VPN/peering).")
    login_vm_size: str = key("loginVmSize", "Standard_D8s_v5",
        "Size of the login/controller VM (a general-purpose size from the known list).")
    bastion_subnet_cidr: str = key("bastionSubnetCidr", "10.42.1.0/26",
        "AzureBastionSubnet (with access bastion): /26 or larger, inside vnetCidr.")
    training_user: str = key("trainingUser", "",
        "Linux user training jobs run as; empty = adminUsername. Owns the model checkpoint directory.")
    training_group: str = key("trainingGroup", "training",
        "Group of every training user; the checkpoint tree is group-writable and setgid to it, so every rank writes.")
    vm_size: str = key("vmSize", "Standard_ND96isr_H100_v5",
        "GPU node size; must be an ND-series size.")
    trusted_launch: str = key("trustedLaunch", "auto",
        "Trusted Launch (vTPM; Secure Boot stays off: the image's kernel modules are DKMS-built) on the login VM and GPU nodes: auto (where the size supports it; not ND A100 v4), on or off (Standard).")
    owner: str = key("owner", "",
        "Value of the owner tag on every resource (team or person to ask about the stack); empty = unassigned.")
    tools_upload_cidr: str = key("toolsUploadCidr", "",
        "Public IPv4 address/CIDR `pulumi up` uploads the toolkit from; set it to close the tools account to everything else but the compute subnet.")
    node_count: int = key("nodeCount", 1,
        "Number of GPU nodes.")
    node_ethernet_gbps: int = key("nodeEthernetGbps", 0,
        "Per-node Ethernet in Gbit/s for the sizing model; 0 = known value for the VM size.")
    # Zone-redundant by default: the archive is the only durable copy of every checkpoint, and the
    # file system is zonal (`zone`), so a zone outage must not take the archive with it. AMLFS blob
    # integration accepts every Standard redundancy (LRS, ZRS, GRS, RA-GRS, GZRS, RA-GZRS; Premium
    # block blob LRS/ZRS): https://learn.microsoft.com/azure/azure-managed-lustre/amlfs-prerequisites
    # ("Supported storage account types"). The lifecycle tiers to Cool/Cold only, which ZRS supports
    # (the Archive tier, which it does not, is never used). GZRS adds an asynchronous copy in the
    # paired region, for a disaster-recovery plan that has compute there too.
    storage_sku: str = key("storageSku", "Standard_ZRS",
        "Storage account redundancy of the archive (the only durable copy): Standard_ZRS (default, survives a zone outage), Standard_GZRS for a second region, Standard_LRS for a throw-away stack.")
    checkpoint_prefix: str = key("checkpointPrefix", "/checkpoints",
        "Absolute Lustre path of the checkpoint root under /lustrefs; also the blob prefix exported and imported.")
    model_name: str = key("modelName", "default",
        "Model directory under the checkpoint root (the toolkit's `model`).")
    checkpoint_size_gib: int = key("checkpointSizeGiB", 912,
        "Size of one checkpoint in GiB (sizing model).")
    checkpoint_interval_seconds: int = key("checkpointIntervalSeconds", 1800,
        "Seconds between checkpoints (sizing model, archive keep-up check).")
    allow_archive_backlog: bool = key("allowArchiveBacklog", False,
        "Accept a checkpoint interval shorter than the archive time (the export backlog then grows).")
    data_mover_gbps: float = key("dataMoverGBps", "7.5",
        "Lustre-to-Blob export rate in GB/s (7.5 = the account's default ingress).")
    cool_after_days: int = key("coolAfterDays", 30,
        "Lifecycle: move archived checkpoints to the cool tier after N days (0 = never).")
    cold_after_days: int = key("coldAfterDays", 90,
        "Lifecycle: move them to the cold tier after N days (0 = never).")
    delete_after_days: int = key("deleteAfterDays", 0,
        "Refused unless 0: an age-based Blob delete would expire the newest checkpoints too; use `tiered-ckpt archive retention`.")
    soft_delete_days: int = key("softDeleteDays", 14,
        "Blob soft delete retention, 1-365 days.")
    # The node retention keys take the node config's defaults and rules (tiered_ckpt.config.RetentionConfig),
    # except the action: a cluster's checkpoints live on AMLFS, where release keeps the namespace.
    retention_keep_last: int = key("retentionKeepLast", _RETENTION.keep_last,
        "Node retention: keep the newest N committed checkpoints on Lustre.")
    retention_keep_every_steps: int = key("retentionKeepEverySteps", _RETENTION.keep_every_steps,
        "Node retention: also keep every checkpoint whose step is a multiple of K (0 = off).")
    retention_min_keep: int = key("retentionMinKeep", _RETENTION.min_keep,
        "Node retention: never go below N committed checkpoints on Lustre.")
    retention_action: str = key("retentionAction", "release",
        "Node retention action for archived checkpoints: release (keep namespace, free data) or delete.")
    memory_keep: int = key("memoryKeep", 0,
        "Memory tier: newest checkpoints kept per rank in node RAM (/dev/shm/tiered-ckpt), each replicated to a peer node; 0 = off. The plan checks memoryKeep x 2 copies of a node's share against the VM's RAM.")
    retention_schedule: str = key("retentionSchedule", "*:0/15",
        "systemd OnCalendar schedule of the retention timer.")
    rp_principal_object_id: str = key("rpPrincipalObjectId", "",
        "Object ID of the HPC Cache Resource Provider service principal; empty = look it up by its appId.")
    role_wait_duration: str = key("roleWaitDuration", "5m",
        "Wait between the storage role grants and the file system (role propagation), e.g. 5m, 90s.")
    blob_job_wait_minutes: int = key("blobJobWaitMinutes", 240,
        "How long `pulumi up` waits for the creation-time import to finish before creating auto-export.")

    @property
    def base_name(self) -> str:
        """`<prefix>-<stack>`: the stem of every resource name."""
        return f"{self.name_prefix}-{self.stack}"

    @property
    def node_security(self) -> vm_security.VmSecurity:
        """The ND nodes' security profile and boot path (components/settings/vm_security.py)."""
        return vm_security.vm_security(self.vm_size, self.trusted_launch)

    @property
    def login_security(self) -> vm_security.VmSecurity:
        """The login VM's security profile and boot path."""
        return vm_security.vm_security(self.login_vm_size, self.trusted_launch)

    @property
    def vm_ram_gib(self) -> int:
        """Host RAM of the GPU node size (0 when the size is not in ND_RAM_GIB)."""
        return ND_RAM_GIB.get(self.vm_size, 0)

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


SCHEMA: tuple[Key, ...] = tuple(
    Key(f.metadata[_KEY][0], f.name, _PULUMI_TYPES.get(str(f.type), "string"), f.metadata[_KEY][1], f.metadata[_KEY][2])
    for f in fields(Settings) if _KEY in f.metadata
)
SCHEMA_BY_NAME = {k.name: k for k in SCHEMA}


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


# Each check below yields every problem it finds (one SettingsError per key) instead of stopping at the
# first, so one `pulumi up` names everything to fix; it returns early only where a later test would be
# meaningless without an earlier value (a capacity check needs a known SKU).
Problems = Iterator[SettingsError]


def _check_storage(s: dict[str, Any]) -> Problems:
    if s["storageSku"] not in STORAGE_SKUS:
        yield _fail("storageSku", s["storageSku"], "is not a supported redundancy", f"use one of {', '.join(STORAGE_SKUS)}")
    if not (1 <= s["softDeleteDays"] <= 365):
        yield _fail("softDeleteDays", s["softDeleteDays"], "is outside 1-365", "set the blob soft delete retention in days, e.g. 14")
    if s["deleteAfterDays"]:
        # A lifecycle rule deletes by age alone (daysAfterModificationGreaterThan): it would expire the
        # newest and only checkpoints of a paused campaign. No lifecycle filter can spare "the newest N".
        yield _fail("deleteAfterDays", s["deleteAfterDays"],
                    "would let the Blob lifecycle policy delete checkpoints by age, the newest ones included",
                    "remove it (pulumi config rm tiered:deleteAfterDays) and expire old checkpoints with "
                    "`tiered-ckpt archive retention plan|apply`, which keeps the newest retentionMinKeep committed ones")
    negative = [n for n in ("coolAfterDays", "coldAfterDays") if s[n] < 0]
    for name in negative:
        yield _fail(name, s[name], "is negative", "use a number of days, or 0 for never")
    if not negative:
        steps = [(n, s[n]) for n in ("coolAfterDays", "coldAfterDays") if s[n] > 0]
        for (a, da), (b, db) in zip(steps, steps[1:], strict=False):
            if db <= da:
                yield _fail(b, db, f"is not after {_k(a)} ({da})", f"make {_k(b)} larger than {da}, or 0 for never")
    prefix = s["checkpointPrefix"]
    if not prefix.startswith("/"):
        yield _fail("checkpointPrefix", prefix, "is not an absolute path", "start it with '/', e.g. /checkpoints")
    elif prefix.strip("/") == "" or not re.fullmatch(r"/[A-Za-z0-9._/-]+", prefix) or "//" in prefix or ".." in prefix.split("/"):
        yield _fail("checkpointPrefix", prefix, "is not a usable checkpoint directory", "use a path below the mount such as /checkpoints (letters, digits, . _ - /)")
    else:
        yield from _check_siblings(prefix.strip("/"))
    if not MODEL.fullmatch(s["modelName"]):
        yield _fail("modelName", s["modelName"], "is not a valid model directory name", "use letters, digits, '.', '_' or '-'")


# What else the deployment puts next to the checkpoint prefix: on Lustre (the shared work directory,
# slurmctld's state) and in the data container (archive retention's journal). The AMLFS import prefix
# and auto-export prefix are string prefixes (REST spec: "blobs ... that start with this path/prefix"),
# and no AMLFS doc or spec says a trailing '/' is accepted, so `/checkpoints` would also import and
# export `checkpoints2/...`. The program therefore refuses a prefix that is a string prefix of any of
# these names (docs/deploy.md asks operators to create no sibling such as /lustrefs/checkpoints-old).
WORK_DIR = "work"          # /lustrefs/work: shared by the login VM and every node
SLURM_DIR = ".slurm"       # /lustrefs/.slurm: slurmctld's state (survives a replaced login VM)
SIBLINGS = (WORK_DIR, SLURM_DIR, JOURNAL_PREFIX)


def _check_siblings(blob_prefix: str) -> Problems:
    for other in SIBLINGS:
        if other.startswith(blob_prefix) or blob_prefix.startswith(other.split("/")[0] + "/"):
            yield _fail("checkpointPrefix", "/" + blob_prefix,
                        f"would also match {other!r}, which the deployment keeps next to the checkpoints (AMLFS import "
                        "and auto-export prefixes are string prefixes)",
                        "choose a prefix that no other top-level name starts with, e.g. /checkpoints")


def _check_amlfs(s: dict[str, Any], stack: str) -> Problems:
    sku = SKUS.get(s["sku"])
    if sku is None:
        yield _fail("sku", s["sku"], "is not an AMLFS SKU", f"use one of {', '.join(SKUS)}")
    else:
        tib = s["capacityTiB"]
        if tib < sku.min_tib:
            yield _fail("capacityTiB", tib, f"is below the minimum of {sku.name} ({sku.min_tib} TiB)", f"use {sku.min_tib} or more, in steps of {sku.step_tib}")
        elif tib % sku.step_tib:
            yield _fail("capacityTiB", tib, f"is not a multiple of {sku.name}'s step ({sku.step_tib} TiB)", f"use the nearest valid size: {_nearest_capacities(sku, tib)}")
        elif tib > sku.default_max_tib and not s["allowAboveDefaultMax"]:
            yield _fail("capacityTiB", tib, f"is above {sku.name}'s default maximum ({sku.default_max_tib} TiB per subscription)",
                        f"ask Azure support to raise the quota, then set {_k('allowAboveDefaultMax')} true; or use {sku.default_max_tib} or less")
    if s["maintenanceDay"] not in DAYS:
        yield _fail("maintenanceDay", s["maintenanceDay"], "is not a day of the week", f"use one of {', '.join(DAYS)}")
    if not TIME_OF_DAY.fullmatch(s["maintenanceTimeUtc"]):
        yield _fail("maintenanceTimeUtc", s["maintenanceTimeUtc"], "is not a time of day", "use HH:MM in UTC, 24-hour clock, e.g. 02:00")
    if s["rootSquash"] not in SQUASH_MODES:
        yield _fail("rootSquash", s["rootSquash"], "is not a root squash mode", f"use one of {', '.join(SQUASH_MODES)}")
    for name in (f"{s['namePrefix']}-{stack}-amlfs", f"{s['namePrefix']}-{stack}-autoexport"):
        if not AMLFS_NAME.fullmatch(name):
            yield SettingsError(f"stack name {stack!r}: the derived name {name!r} does not match the API pattern {AMLFS_NAME.pattern}; "
                                "use a stack name of letters, digits and '-' (at most 60 characters)")
            break


def _networks(s: dict[str, Any], names: tuple[str, ...]) -> tuple[dict[str, ipaddress.IPv4Network], list[SettingsError]]:
    nets: dict[str, ipaddress.IPv4Network] = {}
    problems: list[SettingsError] = []
    for name in names:
        try:
            nets[name] = _network(name, s[name])
        except SettingsError as err:
            problems.append(err)
    return nets, problems


def _check_ssh_source(s: dict[str, Any]) -> Problems:
    src, access = s["sshSourcePrefix"], s["access"]
    if not src:
        yield _fail("sshSourcePrefix", src, "is empty", "set the CIDR (or service tag, e.g. VirtualNetwork) SSH may come from")
        return
    if src in ("*", "Internet", "Any") or src in OPEN_PREFIXES:
        yield _fail("sshSourcePrefix", src, "opens SSH to the whole internet", "use your admin network's CIDR, e.g. 203.0.113.0/24")
        return
    if re.fullmatch(r"[0-9./]+", src):
        try:
            ipaddress.ip_network(src, strict=False)
        except ValueError:
            yield _fail("sshSourcePrefix", src, "is not an IP range", "use a CIDR such as 203.0.113.0/24 or a service tag such as VirtualNetwork")
    elif not re.fullmatch(r"[A-Za-z][A-Za-z0-9.]*", src):
        yield _fail("sshSourcePrefix", src, "is neither a CIDR nor a service tag", "use e.g. 203.0.113.0/24 or VirtualNetwork")
    elif access == "public-ip":
        # A public IP is reached from the internet: the NSG must name the admins' own addresses.
        yield _fail("sshSourcePrefix", src, "is a service tag, but access public-ip needs the CIDR your admins connect from",
                    "pulumi config set tiered:sshSourcePrefix <your public CIDR, e.g. 203.0.113.0/24>, or use tiered:access bastion")


def _check_network(s: dict[str, Any], capacity_tib: int) -> Problems:
    # An unknown clusterMode is reported by _check_modes; the checks below then treat it as slurm (the
    # default) so the rest of the stack's problems still show.
    ours = s["clusterMode"] != "none"
    bastion = s["access"] == "bastion" and ours
    names = ("vnetCidr", "amlfsSubnetCidr", "computeSubnetCidr") + (("bastionSubnetCidr",) if bastion else ())
    nets, problems = _networks(s, names)
    yield from problems
    vnet = nets.get("vnetCidr")
    subs = {n: nets[n] for n in names[1:] if n in nets}
    if vnet is not None:
        for name, net in subs.items():
            if not net.subnet_of(vnet):
                yield _fail(name, str(net), f"is not inside {_k('vnetCidr')} ({vnet})", f"pick a range inside {vnet}")
    order = list(subs.items())
    for i, (a, na) in enumerate(order):
        for b, nb in order[i + 1:]:
            if na.overlaps(nb):
                yield _fail(b, str(nb), f"overlaps {_k(a)} ({na})", "give the subnets disjoint ranges; AMLFS and Bastion each need a subnet of their own")
    amlfs, compute = subs.get("amlfsSubnetCidr"), subs.get("computeSubnetCidr")
    need = subnets.required_prefix(capacity_tib)
    if amlfs is not None and amlfs.prefixlen > need:
        yield _fail("amlfsSubnetCidr", str(amlfs), f"is too small for {capacity_tib} TiB (Microsoft recommends /{need} or larger)",
                    f"use a /{need} or larger, e.g. {subnets.example(vnet, need, avoid=compute) if vnet else f'a /{need}'}")
    bas = subs.get("bastionSubnetCidr")
    if bas is not None and bas.prefixlen > BASTION_MIN_PREFIX:
        # Azure Bastion: "AzureBastionSubnet ... subnet size must be /26 or larger" (Bastion configuration settings).
        yield _fail("bastionSubnetCidr", str(bas), f"is smaller than the /{BASTION_MIN_PREFIX} Azure Bastion requires",
                    f"use a /{BASTION_MIN_PREFIX} or larger inside {_k('vnetCidr')}")
    if ours:
        yield from _check_ssh_source(s)


def _check_cluster(s: dict[str, Any]) -> Problems:
    size = s["vmSize"]
    if not re.fullmatch(r"Standard_ND\w+", size):
        yield _fail("vmSize", size, "is not an ND-series size (InfiniBand GPU nodes)", f"use an ND size such as {', '.join(ND_ETHERNET_GBITS)}")
    elif s["nodeEthernetGbps"] == 0 and size not in ND_ETHERNET_GBITS:
        yield _fail("nodeEthernetGbps", 0, f"leaves the Ethernet bandwidth of {size} unknown",
                    f"set {_k('nodeEthernetGbps')} to its Gbit/s from the Azure size page")
    if s["nodeCount"] < 1:
        yield _fail("nodeCount", s["nodeCount"], "is below 1", f"deploy at least one node, or set {_k('computeEnabled')} false to remove the compute side")
    if s["nodeCount"] > MAX_NODES:
        yield _fail("nodeCount", s["nodeCount"], f"exceeds {MAX_NODES} nodes, the limit of one InfiniBand placement group", f"use at most {MAX_NODES} nodes per stack")
    if s["nodeEthernetGbps"] < 0:
        yield _fail("nodeEthernetGbps", s["nodeEthernetGbps"], "is negative", "use 0 (known value for the VM size) or the Gbit/s of the size's Ethernet")
    if s["clusterMode"] == "none":
        return      # no VM of ours: no login size, no SSH key, no admin user to check
    if s["loginVmSize"] not in LOGIN_VM_SIZES:
        yield _fail("loginVmSize", s["loginVmSize"], "is not a known general-purpose size for the login/controller VM",
                    f"use one of {', '.join(LOGIN_VM_SIZES)}")
    key = s["sshPublicKey"].strip()
    if not SSH_KEY.fullmatch(key):
        shown = key[:24] + "..." if len(key) > 24 else key
        if "PRIVATE KEY" in key:
            yield SettingsError(f"{_k('sshPublicKey')}: holds a private key; set the PUBLIC key: pulumi config set {_k('sshPublicKey')} \"$(cat ~/.ssh/id_ed25519.pub)\"")
        else:
            yield _fail("sshPublicKey", shown, "is not an OpenSSH public key", f"pulumi config set {_k('sshPublicKey')} \"$(cat ~/.ssh/id_ed25519.pub)\"")
    if not _linux_name(s["adminUsername"]):
        yield _fail("adminUsername", s["adminUsername"], "is not an allowed Linux user name", "use lowercase letters/digits, not root or admin, e.g. azureuser")


def _check_security(s: dict[str, Any]) -> Problems:
    if s["trustedLaunch"] not in TRUSTED_LAUNCH_MODES:
        yield _fail("trustedLaunch", s["trustedLaunch"], "is not a Trusted Launch mode",
                    "use auto (on where the VM size supports it), on or off")
    elif s["trustedLaunch"] == "on":
        # ARM refuses such a scale set ("The VM size ... is not supported ... with 'TrustedLaunch' security
        # type") only after the file system exists: refuse it here, before anything bills.
        sizes = [("vmSize", s["vmSize"])] + ([("loginVmSize", s["loginVmSize"])] if s["clusterMode"] != "none" else [])
        for name, size in sizes:
            if vm_security.supports_trusted_launch(size) is False:
                yield _fail("trustedLaunch", "on", f"asks for Trusted Launch on {_k(name)} {size}, which does not support it "
                            f"({vm_security.TRUSTED_LAUNCH_SUPPORT[size].source})",
                            "set tiered:trustedLaunch auto (Standard on that size) or off, or pick a size that supports it, e.g. Standard_ND96isr_H100_v5")
    nids = s["rootSquashTrustedNids"].strip()
    if nids:
        bad = [n for n in nids.split(";") if not NID.fullmatch(n.strip()) or any(
            int(x) > 255 for x in re.findall(r"\d+", n.split("@")[0]))]
        if bad:
            yield _fail("rootSquashTrustedNids", nids, f"holds entries that are not Lustre tcp NIDs ({'; '.join(bad)})",
                        "use ';'-separated NIDs such as 10.42.4.[4-254]@tcp;10.42.5.[0-255]@tcp, or leave it empty for the compute subnet")
    owner = s["owner"]
    if len(owner) > 256 or any(c in owner for c in "<>%&\\?/") or not owner.isprintable():
        yield _fail("owner", owner, "is not a valid Azure tag value here", "use at most 256 printable characters without <>%&\\?/, e.g. ml-platform")
    cidr = s["toolsUploadCidr"].strip()
    if cidr:
        try:
            net = ipaddress.ip_network(cidr, strict=False)
        except ValueError:
            yield _fail("toolsUploadCidr", cidr, "is not an IPv4 address or CIDR", "use your public address, e.g. 203.0.113.7 or 203.0.113.0/28")
            return
        if not isinstance(net, ipaddress.IPv4Network) or any(net.overlaps(p) for p in NON_PUBLIC):
            yield _fail("toolsUploadCidr", cidr, "is not a public IPv4 range (storage firewalls take public addresses only)",
                        "use the public address your machine reaches Azure from (e.g. curl -s https://api.ipify.org), or leave it empty")
        elif net.prefixlen == 31:
            yield _fail("toolsUploadCidr", cidr, "is a /31, which storage IP rules do not take", "use a /30 or wider, or a single address")


def _linux_name(name: str) -> bool:
    return bool(re.fullmatch(r"[a-z_][a-z0-9_-]{0,31}", name)) and name not in RESERVED_NAMES


def _check_modes(s: dict[str, Any]) -> Problems:
    if s["clusterMode"] not in CLUSTER_MODES:
        yield _fail("clusterMode", s["clusterMode"], "is not a cluster mode",
                    "use slurm (login/controller VM + ND nodes running Slurm) or none (bring your own cluster: storage and AMLFS only, plus a node bootstrap script)")
    if s["access"] not in ACCESS_MODES:
        yield _fail("access", s["access"], "is not a way in", "use bastion (Azure Bastion, native-client SSH), public-ip (the login VM only, SSH from tiered:sshSourcePrefix) or none")
    user, group = s["trainingUser"], s["trainingGroup"]
    if user and not _linux_name(user):
        yield _fail("trainingUser", user, "is not an allowed Linux user name", "use lowercase letters/digits (not root), or leave it empty to train as tiered:adminUsername")
    if not _linux_name(group) or group == SERVICE_GROUP:
        yield _fail("trainingGroup", group, "is not an allowed Linux group name for training users",
                    f"use lowercase letters/digits other than root or {SERVICE_GROUP}, e.g. training")


def _check_toolkit(s: dict[str, Any]) -> Problems:
    by_setting = {f"retention.{v}": k for k, v in RETENTION_KEYS.items()}
    for setting, rest in section_problems("retention", {v: s[k] for k, v in RETENTION_KEYS.items()}):
        yield SettingsError(f"{_k(by_setting[setting])}: {rest} (the node's {setting}); set it with "
                            f"pulumi config set {_k(by_setting[setting])} <value>")
    if s["memoryKeep"] < 0:
        yield _fail("memoryKeep", s["memoryKeep"], "is below 0", "set a whole number >= 0 (0 = off)")
    why = oncalendar.problem(s["retentionSchedule"])
    if why:
        yield _fail("retentionSchedule", s["retentionSchedule"], f"is not a systemd OnCalendar expression: {why}",
                    "use e.g. *:0/15, hourly or 'Mon..Fri 02:00' (systemd.time(7); check with: systemd-analyze calendar '<value>')")


def _check_common(s: dict[str, Any]) -> Problems:
    if not NAME_PREFIX.fullmatch(s["namePrefix"]):
        yield _fail("namePrefix", s["namePrefix"], "does not match ^[a-z][a-z0-9]{1,9}$ (it is part of the storage account name)",
                    "use 2-10 lowercase letters and digits, starting with a letter")
    if not re.fullmatch(r"[a-z0-9]+", s["location"]):
        yield _fail("location", s["location"], "is not an Azure region name", "use the short name, e.g. eastus, southcentralus")
    if s["zone"] not in ("1", "2", "3"):
        yield _fail("zone", s["zone"], "is not an availability zone", "use 1, 2 or 3 (AMLFS lives in one zone; the nodes follow it)")
    for name in ("checkpointSizeGiB", "checkpointIntervalSeconds", "blobJobWaitMinutes"):
        if s[name] < 1:
            yield _fail(name, s[name], "is below 1", "set a positive whole number")
    if _rate(s["dataMoverGBps"]) is None:
        yield _fail("dataMoverGBps", s["dataMoverGBps"], "is not a positive rate", "use GB/s, e.g. 7.5")
    dur = s["roleWaitDuration"]
    if not dur or not GO_DURATION.fullmatch(dur):
        yield _fail("roleWaitDuration", dur, "is not a duration", "use e.g. 5m, 90s or 1m30s (role grants take up to 5 minutes to apply)")
    oid = s["rpPrincipalObjectId"]
    if oid and not GUID.fullmatch(oid):
        yield _fail("rpPrincipalObjectId", oid, "is not an object ID (GUID)",
                    "leave it empty to look it up, or use: az ad sp show --id 4392ab71-2ce2-4b0d-8770-b352745c73f5 --query id -o tsv")


def _rate(value: str) -> float | None:
    try:
        gbps = float(value)
    except ValueError:
        return None
    return gbps if gbps > 0 else None


def load(raw: Mapping[str, Any], stack: str) -> Settings:
    """Build validated Settings from config values keyed by bare or `tiered:`-qualified names.

    Unset keys take the SCHEMA default. Raises SettingsError naming key, value and fix: one line per
    problem, every problem of the stack at once (`err.problems` holds them one by one).
    """
    if not re.fullmatch(r"[A-Za-z0-9_.-]+", stack):
        raise SettingsError(f"stack name {stack!r}: must be letters, digits, '-', '_' or '.'; create a stack with such a name")
    problems: list[SettingsError] = []
    values: dict[str, Any] = {}
    for full, value in raw.items():
        name = full.split(":", 1)[1] if full.startswith(NAMESPACE + ":") else full
        if ":" in name:
            continue  # provider settings such as azure-native:location are not ours
        if name not in SCHEMA_BY_NAME:
            problems.append(SettingsError(f"{_k(name)}: unknown setting; check the spelling against Pulumi.yaml (known: {', '.join(sorted(SCHEMA_BY_NAME))})"))
            continue
        values[name] = value
    s: dict[str, Any] = {}
    for key in SCHEMA:
        try:
            s[key.name] = _coerce(key, values.get(key.name, key.default))
        except SettingsError as err:
            problems.append(err)
            s[key.name] = _coerce(key, key.default)   # go on with the default so the other checks still run

    problems += [*_check_common(s), *_check_storage(s), *_check_toolkit(s), *_check_amlfs(s, stack), *_check_modes(s), *_check_security(s)]
    if s["computeEnabled"]:
        problems += [*_check_network(s, s["capacityTiB"]), *_check_cluster(s)]
    if problems:
        raise SettingsError.of(problems)
    # Values that validation turned into richer types, or that have derived defaults.
    derived: dict[str, Any] = {
        "sku": SKUS[s["sku"]],
        "data_mover_gbps": _rate(s["dataMoverGBps"]),
        "ssh_public_key": s["sshPublicKey"].strip(),
        "checkpoint_prefix": s["checkpointPrefix"].rstrip("/"),
        "node_ethernet_gbps": s["nodeEthernetGbps"] or ND_ETHERNET_GBITS.get(s["vmSize"], 0),
        "training_user": s["trainingUser"] or s["adminUsername"],
        "root_squash_trusted_nids": s["rootSquashTrustedNids"].strip(),
        "tools_upload_cidr": s["toolsUploadCidr"].strip(),
    }
    settings = Settings(stack=stack, **{k.field: derived.get(k.field, s[k.name]) for k in SCHEMA})
    if settings.compute_enabled:
        check_sizing(settings)
    return settings


def check_sizing(s: Settings) -> sizing.Sizing:
    """Refuse settings whose archive cannot keep up or whose retention set does not fit."""
    z = sizing.compute(s)
    problems: list[SettingsError] = []
    if not z.archive_keeps_up and not s.allow_archive_backlog:
        problems.append(SettingsError(
            f"tiered:checkpointIntervalSeconds: {s.checkpoint_interval_seconds} is shorter than the {z.archive_seconds:.0f} s "
            f"it takes to archive one {s.checkpoint_size_gib} GiB checkpoint at {s.data_mover_gbps:g} GB/s, so the export backlog grows "
            f"without bound; checkpoint every {math.ceil(z.archive_seconds)} s or more, or set tiered:allowArchiveBacklog true"))
    if not z.capacity_ok:
        problems.append(SettingsError(
            f"tiered:capacityTiB: {s.capacity_tib} cannot hold the resident retention set ({z.resident_checkpoints} x "
            f"{s.checkpoint_size_gib} GiB = {z.resident_tib:.1f} TiB); raise capacityTiB or lower tiered:retentionKeepLast"))
    if not z.memory_fits:
        problems.append(SettingsError(
            f"tiered:memoryKeep: {s.memory_keep} needs a {z.memory_tmpfs_gib:.0f} GiB tmpfs per node ({s.memory_keep} x 2 copies "
            f"of a {z.memory_node_share_gib:.0f} GiB node share: own + the peer's replica), more than the "
            f"{MEMORY_TIER_RAM_FRACTION:.0%} of the {z.vm_ram_gib} GiB of {s.vm_size} RAM that /dev/shm gets; lower "
            "tiered:memoryKeep, add nodes (tiered:nodeCount) or set it to 0 (no memory tier)"))
    if problems:
        raise SettingsError.of(problems)
    return z


# Pulumi.yaml's `config:` block is generated from SCHEMA (the one declaration of every key):
# `python -m components.settings --pulumi-yaml` rewrites it; tests fail when the file is stale.
PULUMI_YAML_CONFIG_HEADER = (
    "# Every setting of the program (namespace `tiered:`); any stack file overrides any key, e.g.\n"
    "#   pulumi config set tiered:nodeCount 4 --stack prod\n"
    "# Generated from components/settings/schema.py (python -m components.settings --pulumi-yaml); do not edit.\n"
)


def pulumi_yaml_config() -> str:
    """The `config:` block of Pulumi.yaml, from SCHEMA, with its header comment."""
    import yaml

    block = {k.name: {"type": k.type, "default": k.default, "description": k.description} for k in SCHEMA}
    return PULUMI_YAML_CONFIG_HEADER + yaml.safe_dump({"config": block}, sort_keys=False, width=100_000,
                                                      allow_unicode=True)


def pulumi_yaml(current: str) -> str:
    """Pulumi.yaml's text with its config block (and the comment above it) regenerated; the rest kept."""
    lines = current.splitlines(keepends=True)
    start = next(i for i, line in enumerate(lines) if line.startswith("config:"))
    while start > 0 and lines[start - 1].startswith("#"):
        start -= 1
    return "".join(lines[:start]) + pulumi_yaml_config()
