"""Sizing model (pure): bandwidth, commit and archive times, keep-up check, Lustre capacity.

Units: GB = 10^9 bytes (Azure quotes MB/s), GiB/TiB = 2^30/2^40 (AMLFS capacity, checkpoint sizes).
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any, Protocol

GIB = 1 << 30
TIB = 1 << 40
# The memory tier's tmpfs (/dev/shm) is half the RAM by default (tmpfs(5)): settings.MEMORY_TIER_RAM_FRACTION.
MEMORY_RAM_FRACTION = 0.5


class _Sku(Protocol):
    @property
    def mbps_per_tib(self) -> int: ...


class Inputs(Protocol):
    """What the model reads (settings.Settings has these): sizing depends on no other module."""

    @property
    def sku(self) -> _Sku: ...
    @property
    def capacity_tib(self) -> int: ...
    @property
    def node_ethernet_gbps(self) -> int: ...
    @property
    def node_count(self) -> int: ...
    @property
    def checkpoint_size_gib(self) -> int: ...
    @property
    def data_mover_gbps(self) -> float: ...
    @property
    def checkpoint_interval_seconds(self) -> int: ...
    @property
    def retention_keep_last(self) -> int: ...
    @property
    def retention_min_keep(self) -> int: ...
    @property
    def memory_keep(self) -> int: ...
    @property
    def vm_ram_gib(self) -> int: ...


@dataclass(frozen=True)
class Sizing:
    provisioned_gbps: float          # AMLFS: capacity x MB/s per TiB
    nodes_ethernet_gbps: float       # nodes x per-node Ethernet (Lustre runs over TCP)
    write_gbps: float                # the smaller of the two: what one checkpoint commit sees
    write_limited_by: str            # "amlfs" | "node ethernet"
    nodes_to_fill_amlfs: int
    checkpoint_gib: int
    commit_seconds: float
    data_mover_gbps: float
    archive_seconds: float
    interval_seconds: int
    archive_keeps_up: bool
    resident_checkpoints: int        # newest kept + not yet archived + the one being written
    resident_tib: float
    capacity_tib: int
    capacity_ok: bool
    # The memory tier (memory_keep > 0): per node, keep x 2 copies (own + the peer's replica) of its share.
    memory_keep: int = 0
    memory_node_share_gib: float = 0.0
    memory_tmpfs_gib: float = 0.0
    vm_ram_gib: int = 0
    memory_fits: bool = True

    def as_dict(self) -> dict[str, Any]:
        return {k: (round(v, 3) if isinstance(v, float) else v) for k, v in asdict(self).items()}


def compute(s: Inputs) -> Sizing:
    provisioned = s.sku.mbps_per_tib * s.capacity_tib / 1000.0
    node_gbps = s.node_ethernet_gbps / 8.0
    nodes_eth = s.node_count * node_gbps
    write = min(provisioned, nodes_eth) if nodes_eth > 0 else provisioned
    size_bytes = s.checkpoint_size_gib * GIB
    commit = size_bytes / (write * 1e9)
    archive = size_bytes / (s.data_mover_gbps * 1e9)
    # Checkpoints written while one is still exporting stay un-archived (retention must keep them).
    backlog = math.ceil(archive / s.checkpoint_interval_seconds)
    resident = max(s.retention_keep_last, s.retention_min_keep) + backlog + 1
    resident_tib = resident * size_bytes / TIB
    share = s.checkpoint_size_gib / max(1, s.node_count)
    tmpfs = s.memory_keep * 2 * share
    return Sizing(
        provisioned_gbps=provisioned,
        nodes_ethernet_gbps=nodes_eth,
        write_gbps=write,
        write_limited_by="amlfs" if provisioned <= nodes_eth or nodes_eth == 0 else "node ethernet",
        nodes_to_fill_amlfs=math.ceil(provisioned / node_gbps) if node_gbps else 0,
        checkpoint_gib=s.checkpoint_size_gib,
        commit_seconds=commit,
        data_mover_gbps=s.data_mover_gbps,
        archive_seconds=archive,
        interval_seconds=s.checkpoint_interval_seconds,
        archive_keeps_up=archive <= s.checkpoint_interval_seconds,
        resident_checkpoints=resident,
        resident_tib=resident_tib,
        capacity_tib=s.capacity_tib,
        capacity_ok=resident_tib <= s.capacity_tib,
        memory_keep=s.memory_keep,
        memory_node_share_gib=share,
        memory_tmpfs_gib=tmpfs,
        vm_ram_gib=s.vm_ram_gib,
        # Unknown RAM (a size outside the table) is not refused here; the node boot's df tells.
        memory_fits=s.memory_keep == 0 or not s.vm_ram_gib or tmpfs <= MEMORY_RAM_FRACTION * s.vm_ram_gib,
    )


def report(z: Sizing) -> list[tuple[str, str]]:
    """Human lines for the plan and the stack output."""
    return [
        ("provisioned bandwidth", f"{z.provisioned_gbps:g} GB/s"),
        ("node Ethernet (all nodes)", f"{z.nodes_ethernet_gbps:g} GB/s ({z.nodes_to_fill_amlfs} nodes fill the file system)"),
        ("checkpoint write rate", f"{z.write_gbps:g} GB/s (limited by {z.write_limited_by})"),
        ("commit one checkpoint", f"{z.checkpoint_gib} GiB in {z.commit_seconds:.1f} s"),
        ("archive one checkpoint", f"{z.archive_seconds:.1f} s at {z.data_mover_gbps:g} GB/s"),
        ("checkpoint interval", f"{z.interval_seconds} s ({'archive keeps up' if z.archive_keeps_up else 'BACKLOG GROWS'})"),
        ("resident retention set", f"{z.resident_checkpoints} checkpoints = {z.resident_tib:.1f} TiB of {z.capacity_tib} TiB"),
        ("memory tier per node", "off (tiered:memoryKeep 0)" if not z.memory_keep else
         f"{z.memory_tmpfs_gib:.0f} GiB tmpfs = {z.memory_keep} x 2 copies of a {z.memory_node_share_gib:.0f} GiB node share, "
         f"of {z.vm_ram_gib or '?'} GiB RAM ({'fits' if z.memory_fits else 'DOES NOT FIT'} in /dev/shm's half)"),
    ]
