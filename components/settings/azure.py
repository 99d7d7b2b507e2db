"""Azure facts the settings are checked against (pure data), each with its source: AMLFS SKUs, ND and login
VM sizes, the InfiniBand placement-group limit, Bastion's subnet, AMLFS names and NID lists, Storage firewall
rules. Trusted Launch per size is in vm_security.py, region offers in regions.py, the AMLFS subnet table in
subnets.py."""
from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass


@dataclass(frozen=True)
class Sku:
    name: str
    mbps_per_tib: int
    min_tib: int
    step_tib: int
    default_max_tib: int


# The four AMLFS SKUs (Azure docs, "Azure Managed Lustre file system sizes" / amlfs-overview). Capacity is rounded up by the service, so we demand exact steps.
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

# Host RAM per ND size in GiB (Microsoft's size pages, e.g. learn.microsoft.com/azure/virtual-machines/sizes/
# gpu-accelerated/nd-h100-v5-series and nd-h200-v5-series; ND A100 v4 and NDm A100 v4 pages): what the memory
# tier's tmpfs is checked against.
ND_RAM_GIB: dict[str, int] = {
    "Standard_ND96isr_H100_v5": 1900,
    "Standard_ND96isr_H200_v5": 1850,
    "Standard_ND96amsr_A100_v4": 1900,
    "Standard_ND96asr_v4": 900,
}

# AMLFS root squash modes and the storage account SKUs (REST specs: storagecache amlfs.json rootSquashMode,
# storage/stable/2024-01-01/storage.json SkuName).
SQUASH_MODES = ("None", "RootOnly", "All")
STORAGE_SKUS = ("Standard_LRS", "Standard_GRS", "Standard_RAGRS", "Standard_ZRS", "Standard_GZRS", "Standard_RAGZRS")

# Patterns from the ARM API specs (storagecache amlfs.json for AMLFS names and the maintenance time).
AMLFS_NAME = re.compile(r"^[0-9a-zA-Z][-0-9a-zA-Z_]{0,78}[0-9a-zA-Z]$")
TIME_OF_DAY = re.compile(r"^([0-9]|0[0-9]|1[0-9]|2[0-3]):[0-5][0-9]$")

# One InfiniBand placement group holds at most 100 VMs (ND scale sets keep a single placement group).
MAX_NODES = 100
# Azure Bastion needs a subnet named AzureBastionSubnet of /26 or larger (Bastion configuration settings).
BASTION_MIN_PREFIX = 26
# The login/controller VM runs slurmctld, sbatch and retention, nothing heavy: general-purpose sizes with
# premium disks and accelerated networking (Azure docs, Dv5/Ddv5/Dasv5/Esv5 series).
LOGIN_VM_SIZES = (
    "Standard_D4s_v5", "Standard_D8s_v5", "Standard_D16s_v5", "Standard_D4ds_v5", "Standard_D8ds_v5", "Standard_D16ds_v5",
    "Standard_D4as_v5", "Standard_D8as_v5", "Standard_D16as_v5", "Standard_E4s_v5", "Standard_E8s_v5", "Standard_E16s_v5",
)
# A Lustre NID list as AMLFS's noSquashNidLists takes it (root squash doc: "10.0.2.4@tcp;10.0.2.[6-8]@tcp"):
# ';'-separated NIDs, each octet a number or a [lo-hi] range, on the tcp network.
_NID_OCTET = r"(?:\d{1,3}|\[\d{1,3}-\d{1,3}\])"
NID = re.compile(rf"^{_NID_OCTET}(?:\.{_NID_OCTET}){{3}}@tcp\d*$")
# Azure Storage IP network rules: public IPv4 only; /31 and /32 are given as a bare address (Azure Storage
# firewall docs, "Grant access from an internet IP range").
STORAGE_IP_RULE_MAX_PREFIX = 30
# ...and no private (RFC 1918), loopback, link-local or unspecified ranges.
NON_PUBLIC = tuple(ipaddress.IPv4Network(n) for n in ("10.0.0.0/8", "172.16.0.0/12", "192.168.0.0/16", "127.0.0.0/8", "169.254.0.0/16", "0.0.0.0/8"))
