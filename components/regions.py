"""Does the subscription's region offer the AMLFS SKU (and zone) the stack asks for?

Microsoft publishes no stable, machine-readable list of the regions that offer Azure Managed
Lustre, and what a region offers differs per subscription (restrictions such as
NotAvailableForSubscription). The authoritative answer is ARM's own SKU list for the subscription,
`GET /subscriptions/{id}/providers/Microsoft.StorageCache/skus` (REST operation Skus_List,
storagecache stable/2024-07-01, example Skus_List.json; `az storagecache sku list` and
`Get-AzStorageCacheSku` list the same entries, resourceType `amlFilesystems`, name
`AMLFS-Durable-Premium-<tier>`, per location). A static list in the repository would go stale and
would wrongly refuse a region Microsoft adds or wrongly accept one the subscription cannot use, so
the program asks ARM at `pulumi up`, before the file system is created (ArmCredentialCheck), and
fails with the regions that do offer the SKU. Offline (`make plan`), settings.py validates only
that `location` is an Azure region *name* (short form, e.g. eastus).

Pure: the functions take the REST-shaped SKU entries (dicts as `ResourceSku.as_dict()` or the
JSON body gives them) and return problems; blob_jobs.ArmCredentialCheckProvider does the call.
"""
from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

AMLFS_RESOURCE_TYPE = "amlFilesystems"


def _get(d: Mapping[str, Any], *names: str) -> Any:
    """A field by its REST name or the SDK's snake_case name (as_dict() gives either, by version)."""
    for n in names:
        if n in d:
            return d[n]
    return None


def _norm(location: str) -> str:
    # ARM compares locations without case or spaces ("East US" == "eastus").
    return location.replace(" ", "").lower()


def _restricted(entry: Mapping[str, Any], location: str) -> str | None:
    """The reason code of a Location restriction covering `location`, if any."""
    for r in _get(entry, "restrictions") or []:
        if str(_get(r, "type") or "").lower() != "location":
            continue
        if any(_norm(str(v)) == location for v in (_get(r, "values") or [])):
            return str(_get(r, "reasonCode", "reason_code") or "restricted")
    return None


def offering_locations(skus: Iterable[Mapping[str, Any]], sku: str) -> list[str]:
    """Locations where `sku` (an AMLFS SKU name) is listed and not restricted for this subscription."""
    out: set[str] = set()
    for e in skus:
        if _get(e, "resourceType", "resource_type") != AMLFS_RESOURCE_TYPE or _get(e, "name") != sku:
            continue
        for loc in _get(e, "locations") or []:
            if _restricted(e, _norm(str(loc))) is None:
                out.add(_norm(str(loc)))
    return sorted(out)


def region_problem(skus: Iterable[Mapping[str, Any]], sku: str, location: str, zone: str | None) -> str | None:
    """One sentence naming what the region lacks and the fix, or None when it offers the SKU (and zone)."""
    entries = [e for e in skus if _get(e, "resourceType", "resource_type") == AMLFS_RESOURCE_TYPE]
    loc = _norm(location)
    everywhere = offering_locations(entries, sku)
    where = ", ".join(everywhere) if everywhere else "none"
    here = [e for e in entries if _get(e, "name") == sku and loc in {_norm(str(x)) for x in _get(e, "locations") or []}]
    if not here:
        return (f"location {location!r} does not offer AMLFS SKU {sku!r} to this subscription (regions that do: {where}); "
                "set tiered:location to one of them, or tiered:sku to a SKU the region offers "
                "(`az storagecache sku list --query \"[?resourceType=='amlFilesystems']\"`)")
    reasons = [r for r in (_restricted(e, loc) for e in here) if r]
    if len(reasons) == len(here):
        return (f"location {location!r} lists AMLFS SKU {sku!r} but restricts it for this subscription ({reasons[0]}); "
                f"regions without that restriction: {where}. Request access (Azure support: quota/region access) or set "
                "tiered:location to one of them")
    if zone is not None:
        zones: set[str] = set()
        known = False
        for e in here:
            for info in _get(e, "locationInfo", "location_info") or []:
                if _norm(str(_get(info, "location") or "")) == loc:
                    known = True
                    zones.update(str(z) for z in _get(info, "zones") or [])
        # An entry with no zone information says nothing about zones: only refuse what ARM says is absent.
        if known and zones and str(zone) not in zones:
            return (f"AMLFS SKU {sku!r} in {location!r} is offered in zones {', '.join(sorted(zones))}, not zone {zone}; "
                    "set tiered:zone to one of them")
    return None
