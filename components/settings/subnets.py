"""AMLFS subnet sizing (pure): the smallest CIDR prefix Microsoft recommends for a capacity.

Source: "Azure Managed Lustre file system prerequisites", network size requirements table
(4-16 TiB /27, 20-40 /26, 44-92 /25, 96-196 /24, 200-400 /23). Azure reserves 5 addresses per
subnet and the file system can never move to another subnet, so we refuse anything smaller.
Above 400 TiB the table stops; we ask for a /22 and the deploy-time API
(get_required_aml_fs_subnets_size) remains the authority.
"""
from __future__ import annotations

import ipaddress

# (largest capacity in TiB, minimum prefix length)
TABLE: tuple[tuple[int, int], ...] = ((16, 27), (40, 26), (92, 25), (196, 24), (400, 23))
ABOVE_TABLE_PREFIX = 22


def required_prefix(capacity_tib: int) -> int:
    """Largest prefix length (smallest subnet) recommended for `capacity_tib`."""
    for top, prefix in TABLE:
        if capacity_tib <= top:
            return prefix
    return ABOVE_TABLE_PREFIX


def example(vnet: ipaddress.IPv4Network, prefix: int, avoid: ipaddress.IPv4Network | None = None) -> str:
    """A concrete subnet of `vnet` with `prefix` that does not overlap `avoid`, for error messages."""
    if prefix < vnet.prefixlen:
        return f"a /{prefix} (and widen the VNet beyond {vnet})"
    for cand in vnet.subnets(new_prefix=prefix):
        if avoid is None or not cand.overlaps(avoid):
            return str(cand)
    return f"a /{prefix}"
