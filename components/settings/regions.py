"""Does the subscription's region offer the AMLFS SKU (and zone) the stack asks for?

Microsoft publishes no stable, machine-readable list of the regions that offer Azure Managed
Lustre, and what a region offers differs per subscription (restrictions such as
NotAvailableForSubscription). The authoritative answer is ARM's own SKU list for the subscription,
`GET /subscriptions/{id}/providers/Microsoft.StorageCache/skus` (REST operation Skus_List,
storagecache stable/2024-07-01, example Skus_List.json). That example, the spec's only one, shows
HPC Cache entries (`resourceType: "caches"`); the AMLFS entries' resourceType is not specified there, so
entries are matched by their `AMLFS-` name (and a resourceType of amlFilesystems in any case), and when
the list holds no AMLFS entry at all the provider's own registration is read instead
(`GET /subscriptions/{id}/providers/Microsoft.StorageCache`, Microsoft.Resources 2021-04-01 Providers_Get:
`resourceTypes[amlFilesystems].locations` and `.zoneMappings[].zones`).

The same preflight reads the compute SKU list for the VM sizes (`GET /subscriptions/{id}/providers/
Microsoft.Compute/skus?$filter=location eq '<loc>'`, Microsoft.Compute Skus stable/2021-07-01,
ResourceSkus_List, example ListAvailableResourceSkusForARegion.json): a size missing in the location or
zone, restricted for the subscription (restrictions of type Location / Zone, reasonCode QuotaId or
NotAvailableForSubscription), or carrying the capability `TrustedLaunchDisabled: True` while the program
asks for Trusted Launch is refused before anything bills. A static list in the repository would go stale and
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
AMLFS_SKU_PREFIX = "amlfs-"


def _get(d: Mapping[str, Any], *names: str) -> Any:
    """A field by its REST name or the SDK's snake_case name (as_dict() gives either, by version)."""
    for n in names:
        if n in d:
            return d[n]
    return None


def _norm(location: str) -> str:
    # ARM compares locations without case or spaces ("East US" == "eastus").
    return location.replace(" ", "").lower()


def _is_amlfs(entry: Mapping[str, Any]) -> bool:
    """An AMLFS SKU entry: named AMLFS-..., or typed amlFilesystems (compared without case)."""
    return (str(_get(entry, "name") or "").lower().startswith(AMLFS_SKU_PREFIX)
            or str(_get(entry, "resourceType", "resource_type") or "").lower() == AMLFS_RESOURCE_TYPE.lower())


def _same_name(entry: Mapping[str, Any], name: str) -> bool:
    return str(_get(entry, "name") or "").lower() == name.lower()


def _restricted(entry: Mapping[str, Any], location: str) -> str | None:
    """The reason code of a Location restriction covering `location`, if any."""
    for r in _get(entry, "restrictions") or []:
        if str(_get(r, "type") or "").lower() != "location":
            continue
        if any(_norm(str(v)) == location for v in (_get(r, "values") or [])):
            return str(_get(r, "reasonCode", "reason_code") or "restricted")
    return None


def _zones(entry: Mapping[str, Any], location: str) -> tuple[bool, set[str]]:
    """(whether the entry has zone information for `location`, the zones it lists there)."""
    known, zones = False, set[str]()
    for info in _get(entry, "locationInfo", "location_info") or []:
        if _norm(str(_get(info, "location") or "")) == location:
            known = True
            zones.update(str(z) for z in _get(info, "zones") or [])
    return known, zones


def _restricted_zones(entry: Mapping[str, Any], location: str) -> tuple[set[str], str]:
    """Zones a Zone restriction takes away in `location` (restrictionInfo.zones), with its reason code."""
    out, reason = set[str](), ""
    for r in _get(entry, "restrictions") or []:
        if str(_get(r, "type") or "").lower() != "zone":
            continue
        info = _get(r, "restrictionInfo", "restriction_info") or {}
        if any(_norm(str(v)) == location for v in (_get(info, "locations") or _get(r, "values") or [])):
            out.update(str(z) for z in _get(info, "zones") or [])
            reason = str(_get(r, "reasonCode", "reason_code") or "restricted")
    return out, reason


def provider_entries(provider: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The StorageCache provider registration (Providers_Get) as SKU-list-shaped AMLFS entries, one per
    location of resourceTypes[amlFilesystems] with its zoneMappings; the SKU name is unknown there ("*")."""
    out: list[dict[str, Any]] = []
    for rt in _get(provider, "resourceTypes", "resource_types") or []:
        if str(_get(rt, "resourceType", "resource_type") or "").lower() != AMLFS_RESOURCE_TYPE.lower():
            continue
        zones = {_norm(str(_get(z, "location") or "")): [str(x) for x in _get(z, "zones") or []]
                 for z in _get(rt, "zoneMappings", "zone_mappings") or []}
        for loc in _get(rt, "locations") or []:
            n = _norm(str(loc))
            out.append({"resourceType": AMLFS_RESOURCE_TYPE, "name": "*", "locations": [n],
                        "locationInfo": [{"location": n, "zones": zones.get(n, [])}], "restrictions": []})
    return out


def offering_locations(skus: Iterable[Mapping[str, Any]], sku: str) -> list[str]:
    """Locations where `sku` (an AMLFS SKU name) is listed and not restricted for this subscription."""
    out: set[str] = set()
    for e in skus:
        if not _is_amlfs(e) or not (_same_name(e, sku) or _get(e, "name") == "*"):
            continue
        for loc in _get(e, "locations") or []:
            if _restricted(e, _norm(str(loc))) is None:
                out.add(_norm(str(loc)))
    return sorted(out)


def region_problem(skus: Iterable[Mapping[str, Any]], sku: str, location: str, zone: str | None,
                   provider: Mapping[str, Any] | None = None) -> str | None:
    """One sentence naming what the region lacks and the fix, or None when it offers the SKU (and zone).
    `provider` (the StorageCache registration) is used only when the SKU list has no AMLFS entry."""
    entries: list[Mapping[str, Any]] = [e for e in skus if _is_amlfs(e)]
    source = "the subscription's StorageCache SKU list"
    if not entries and provider is not None:
        entries, source = list(provider_entries(provider)), "the StorageCache provider's amlFilesystems locations"
    loc = _norm(location)
    everywhere = offering_locations(entries, sku)
    where = ", ".join(everywhere) if everywhere else "none"
    here = [e for e in entries if (_same_name(e, sku) or _get(e, "name") == "*")
            and loc in {_norm(str(x)) for x in _get(e, "locations") or []}]
    if not here:
        return (f"location {location!r} does not offer AMLFS SKU {sku!r} to this subscription ({source}; regions that do: {where}); "
                "set tiered:location to one of them, or tiered:sku to a SKU the region offers "
                "(`az storagecache sku list --query \"[?starts_with(name, 'AMLFS-')]\"`)")
    reasons = [r for r in (_restricted(e, loc) for e in here) if r]
    if len(reasons) == len(here):
        return (f"location {location!r} lists AMLFS SKU {sku!r} but restricts it for this subscription ({reasons[0]}); "
                f"regions without that restriction: {where}. Request access (Azure support: quota/region access) or set "
                "tiered:location to one of them")
    if zone is not None:
        zones: set[str] = set()
        known = False
        for e in here:
            k, z = _zones(e, loc)
            known, zones = known or k, zones | z
        # An entry with no zone information says nothing about zones: only refuse what ARM says is absent.
        if known and zones and str(zone) not in zones:
            return (f"AMLFS SKU {sku!r} in {location!r} is offered in zones {', '.join(sorted(zones))}, not zone {zone}; "
                    "set tiered:zone to one of them")
    return None


def _capability(entry: Mapping[str, Any], name: str) -> str | None:
    for c in _get(entry, "capabilities") or []:
        if str(_get(c, "name") or "").lower() == name.lower():
            return str(_get(c, "value"))
    return None


def vm_size_problems(skus: Iterable[Mapping[str, Any]], location: str, zone: str | None,
                     vms: Iterable[Mapping[str, Any]]) -> list[str]:
    """Every problem of the stack's VM sizes in the compute SKU list of `location`, one sentence each.

    `vms`: {"key": the setting (vmSize | loginVmSize), "size": the VM size, "trusted_launch": whether the
    program asks for securityType TrustedLaunch}. Checks, per size: listed as a virtualMachines SKU in the
    location; no Location restriction; the stack's zone among locationInfo.zones and not taken by a Zone
    restriction; no `TrustedLaunchDisabled: True` capability when Trusted Launch is asked for."""
    loc = _norm(location)
    entries = [e for e in skus if str(_get(e, "resourceType", "resource_type") or "").lower() == "virtualmachines"
               and loc in {_norm(str(x)) for x in _get(e, "locations") or []}]
    problems: list[str] = []
    for vm in vms:
        key, size = str(vm["key"]), str(vm["size"])
        here = [e for e in entries if _same_name(e, size)]
        if not here:
            problems.append(f"tiered:{key}: {size} is not offered in {location!r} to this subscription (Microsoft.Compute/skus); "
                            f"set tiered:location to a region that offers it, or tiered:{key} to a size offered here "
                            f"(`az vm list-skus -l {location} --size {size} -o table`)")
            continue
        e = here[0]
        reason = _restricted(e, loc)
        if reason:
            problems.append(f"tiered:{key}: {size} is restricted in {location!r} for this subscription ({reason}); "
                            f"request access or quota (Azure support), or set tiered:location or tiered:{key}")
            continue
        if zone is not None:
            known, zones = _zones(e, loc)
            gone, why = _restricted_zones(e, loc)
            usable = zones - gone
            if (known and str(zone) not in usable) or str(zone) in gone:
                shown = ", ".join(sorted(usable)) or "none"
                extra = f" (zones {', '.join(sorted(gone))} restricted: {why})" if gone else ""
                problems.append(f"tiered:{key}: {size} is not offered in zone {zone} of {location!r} (zones it is: {shown}){extra}; "
                                "set tiered:zone to one of them (the file system and the VMs share it), or pick another size")
        if vm.get("trusted_launch") and str(_capability(e, "TrustedLaunchDisabled") or "").lower() == "true":
            problems.append(f"tiered:trustedLaunch: {size} ({key}) reports TrustedLaunchDisabled in {location!r} "
                            "(Microsoft.Compute/skus), so ARM would refuse a TrustedLaunch VM of that size; "
                            "set tiered:trustedLaunch auto or off, or pick a size that supports Trusted Launch")
    return problems
