"""`location` is checked against the subscription's own AMLFS SKU list before the file system exists."""
from __future__ import annotations

import base64
import subprocess
import sys
from pathlib import Path

import pytest
from pulumi.dynamic.dynamic import serialize_provider

from components.resources.blob_jobs import ArmCredentialCheckProvider
from components.settings.regions import offering_locations, region_problem


def _sku(name: str, locations: list[str], zones: list[str] | None = None, restrictions: list[dict] | None = None) -> dict:
    # Shaped like Skus_List.json (storagecache stable/2024-07-01) with AMLFS entries.
    return {"resourceType": "amlFilesystems", "name": name, "locations": locations,
            "locationInfo": [{"location": loc, "zones": zones or []} for loc in locations],
            "capabilities": [], "restrictions": restrictions or []}


SKUS = [
    _sku("AMLFS-Durable-Premium-500", ["eastus"], ["1", "2", "3"]),
    _sku("AMLFS-Durable-Premium-500", ["westeurope"], ["1", "2"]),
    _sku("AMLFS-Durable-Premium-125", ["southcentralus"], ["1"]),
    _sku("AMLFS-Durable-Premium-500", ["uksouth"], ["1"],
         [{"type": "Location", "values": ["uksouth"], "reasonCode": "NotAvailableForSubscription"}]),
    {"resourceType": "caches", "name": "Standard_2G", "locations": ["northeurope"], "locationInfo": [], "restrictions": []},
]


def test_an_offered_region_and_zone_pass_whatever_the_case_of_the_location() -> None:
    assert region_problem(SKUS, "AMLFS-Durable-Premium-500", "eastus", "3") is None
    assert region_problem(SKUS, "AMLFS-Durable-Premium-500", "East US", "1") is None
    assert region_problem(SKUS, "AMLFS-Durable-Premium-500", "westeurope", None) is None


def test_a_region_without_the_sku_is_refused_naming_the_regions_that_offer_it() -> None:
    msg = region_problem(SKUS, "AMLFS-Durable-Premium-500", "northeurope", "1")
    assert msg is not None
    assert "'northeurope' does not offer AMLFS SKU 'AMLFS-Durable-Premium-500'" in msg
    assert "eastus, westeurope" in msg and "uksouth" not in msg        # the restricted one is not offered
    assert "tiered:location" in msg
    # An HPC Cache SKU in a region does not make it an AMLFS region.
    assert offering_locations(SKUS, "Standard_2G") == []
    assert region_problem(SKUS, "AMLFS-Durable-Premium-125", "eastus", "1") is not None


def test_a_restricted_region_and_a_missing_zone_are_refused_with_the_fix() -> None:
    msg = region_problem(SKUS, "AMLFS-Durable-Premium-500", "uksouth", "1")
    assert msg is not None and "NotAvailableForSubscription" in msg and "restricts" in msg
    msg = region_problem(SKUS, "AMLFS-Durable-Premium-500", "westeurope", "3")
    assert msg is not None and "zones 1, 2, not zone 3" in msg and "tiered:zone" in msg
    # No zone information for a location: nothing to refuse on zones.
    assert region_problem([_sku("AMLFS-Durable-Premium-40", ["eastus2"])], "AMLFS-Durable-Premium-40", "eastus2", "2") is None


def test_sdk_snake_case_entries_are_read_as_well() -> None:
    entry = {"resource_type": "amlFilesystems", "name": "AMLFS-Durable-Premium-250", "locations": ["japaneast"],
             "location_info": [{"location": "japaneast", "zones": ["1"]}],
             "restrictions": [{"type": "Location", "values": ["japaneast"], "reason_code": "QuotaId"}]}
    msg = region_problem([entry], "AMLFS-Durable-Premium-250", "japaneast", "1")
    assert msg is not None and "QuotaId" in msg


def _client(arm_double, token: str):  # type: ignore[no-untyped-def]
    from azure.mgmt.storagecache import StorageCacheManagementClient

    from tests.doubles.arm_double import StaticTokenCredential
    return StorageCacheManagementClient(StaticTokenCredential(token), arm_double.subscription_id, base_url=arm_double.endpoint,
                                        connection_verify=str(arm_double.ca_cert), retry_total=0)


def test_the_preflight_reads_the_sku_list_through_the_real_sdk_and_refuses_an_unoffered_region(arm_double) -> None:  # type: ignore[no-untyped-def]
    from tests.doubles.arm_double import NODE_TOKEN, OPERATOR_TOKEN

    op = _client(arm_double, OPERATOR_TOKEN)
    ArmCredentialCheckProvider.check_region(op, arm_double.location, "AMLFS-Durable-Premium-500", "1")
    assert (OPERATOR_TOKEN, "Microsoft.StorageCache/skus/read") in arm_double.authorized
    with pytest.raises(RuntimeError) as e:
        ArmCredentialCheckProvider.check_region(op, "brazilsouth", "AMLFS-Durable-Premium-500", "1")
    assert "'brazilsouth' does not offer" in str(e.value) and arm_double.location in str(e.value)
    assert "Nothing was created after this check" in str(e.value)
    arm_double.scenario.skus = [_sku("AMLFS-Durable-Premium-500", [arm_double.location], ["2"])]
    with pytest.raises(RuntimeError, match="not zone 1"):
        ArmCredentialCheckProvider.check_region(op, arm_double.location, "AMLFS-Durable-Premium-500", "1")
    # A file-system-scoped role (the nodes') may not list SKUs: ARM answers 403 and the message says what is needed.
    with pytest.raises(RuntimeError) as e:
        ArmCredentialCheckProvider.check_region(_client(arm_double, NODE_TOKEN), arm_double.location, "AMLFS-Durable-Premium-500", "2")
    assert "AuthorizationFailed" in str(e.value) and "Microsoft.StorageCache/skus/read" in str(e.value)


def test_the_program_hands_location_sku_and_zone_to_the_preflight(plan) -> None:  # type: ignore[no-untyped-def]
    r = plan("prod")
    [check] = [x for x in r.resources if x.type.endswith("ArmCredentialCheck")]
    [fs] = [x for x in r.resources if x.type == "azure-native:storagecache:AmlFilesystem"]
    assert check.inputs["location"] == fs.inputs["location"]
    assert check.inputs["sku"] == fs.inputs["sku"]["name"]
    assert check.inputs["zone"] == fs.inputs["zones"][0]


def test_the_pickled_preflight_checks_regions_without_the_project_on_the_path(tmp_path: Path) -> None:
    blob = serialize_provider(ArmCredentialCheckProvider())
    code = ("import base64, dill, sys; p = dill.loads(base64.b64decode(sys.stdin.read())); "
            "ok = [{'resourceType': 'amlFilesystems', 'name': 'S', 'locations': ['eastus'], 'locationInfo': [], 'restrictions': []}]; "
            "print(p.region_problem(ok, 'S', 'eastus', '1'), 'westus' in (p.region_problem(ok, 'S', 'westus', '1') or ''))")
    r = subprocess.run([sys.executable, "-c", code], input=blob, capture_output=True, text=True, cwd=tmp_path,
                       env={"PATH": "/usr/bin:/bin"}, timeout=50)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "None True"
    assert base64.b64decode(blob)


# --- item 8: matching AMLFS entries as ARM may spell them, and the provider fallback ---

def test_amlfs_entries_match_by_name_whatever_their_resource_type_and_case() -> None:
    # Skus_List.json, the spec's only example, types its entries "caches": an AMLFS- name counts whatever the type.
    caches_typed = [{"resourceType": "caches", "name": "AMLFS-Durable-Premium-500", "locations": ["eastus"],
                     "locationInfo": [{"location": "eastus", "zones": ["1", "2"]}], "restrictions": []}]
    assert region_problem(caches_typed, "AMLFS-Durable-Premium-500", "eastus", "2") is None
    assert "not zone 3" in (region_problem(caches_typed, "AMLFS-Durable-Premium-500", "eastus", "3") or "")
    other_case = [dict(caches_typed[0], resourceType="AmlFilesystems", name="amlfs-durable-premium-500")]
    assert region_problem(other_case, "AMLFS-Durable-Premium-500", "eastus", "1") is None
    assert offering_locations(other_case, "AMLFS-Durable-Premium-500") == ["eastus"]


PROVIDER = {"namespace": "Microsoft.StorageCache", "resourceTypes": [
    {"resourceType": "caches", "locations": ["North Europe"]},
    {"resourceType": "amlFilesystems", "locations": ["East US", "West Europe"],
     "zoneMappings": [{"location": "East US", "zones": ["1", "2", "3"]}, {"location": "West Europe", "zones": ["1"]}]}]}


def test_without_amlfs_entries_the_providers_amlfs_locations_and_zone_mappings_decide() -> None:
    hpc_cache_only = [SKUS[-1]]
    assert region_problem(hpc_cache_only, "AMLFS-Durable-Premium-500", "eastus", "3", PROVIDER) is None
    msg = region_problem(hpc_cache_only, "AMLFS-Durable-Premium-500", "northeurope", "1", PROVIDER)
    assert msg is not None and "amlFilesystems locations" in msg and "eastus, westeurope" in msg
    assert "not zone 2" in (region_problem(hpc_cache_only, "AMLFS-Durable-Premium-500", "westeurope", "2", PROVIDER) or "")


def test_the_preflight_falls_back_to_the_provider_registration_through_the_real_sdk(arm_double) -> None:  # type: ignore[no-untyped-def]
    from tests.doubles.arm_double import OPERATOR_TOKEN

    op = _client(arm_double, OPERATOR_TOKEN)
    arm_double.scenario.skus = [SKUS[-1]]          # no AMLFS entry at all
    ArmCredentialCheckProvider.check_region(op, arm_double.location, "AMLFS-Durable-Premium-500", "2", arm_double.subscription_id)
    assert arm_double.kinds("provider.get") == ["provider.get"]
    with pytest.raises(RuntimeError, match="'brazilsouth' does not offer AMLFS SKU"):
        ArmCredentialCheckProvider.check_region(op, "brazilsouth", "AMLFS-Durable-Premium-500", "1", arm_double.subscription_id)


# --- item 9: the VM sizes against Microsoft.Compute/skus, before anything bills ---

A100_LOGIN_TL = [{"key": "vmSize", "size": "Standard_ND96amsr_A100_v4", "trusted_launch": True},
                 {"key": "loginVmSize", "size": "Standard_D8s_v5", "trusted_launch": True}]


def test_the_preflight_refuses_trusted_launch_on_a100_v4_and_a_size_missing_in_the_zone(arm_double) -> None:  # type: ignore[no-untyped-def]
    from tests.doubles.arm_double import OPERATOR_TOKEN, compute_sku

    op = _client(arm_double, OPERATOR_TOKEN)
    loc, sub = arm_double.location, arm_double.subscription_id
    ok = [{"key": "vmSize", "size": "Standard_ND96isr_H100_v5", "trusted_launch": True},
          {"key": "loginVmSize", "size": "Standard_D8s_v5", "trusted_launch": True}]
    arm_double.scenario.compute_skus_page = 2       # the list comes in pages (nextLink): all are read
    ArmCredentialCheckProvider.check_vm_sizes(op, sub, loc, "1", ok)
    assert len(arm_double.kinds("computeSkus.get")) == 4
    assert (OPERATOR_TOKEN, "Microsoft.Compute/skus/read") in arm_double.authorized
    with pytest.raises(RuntimeError) as e:
        ArmCredentialCheckProvider.check_vm_sizes(op, sub, loc, "1", A100_LOGIN_TL)
    msg = str(e.value)
    assert ("tiered:trustedLaunch: Standard_ND96amsr_A100_v4 (vmSize) reports TrustedLaunchDisabled in 'eastus' "
            "(Microsoft.Compute/skus), so ARM would refuse a TrustedLaunch VM of that size") in msg
    assert "Standard_D8s_v5" not in msg and msg.endswith("Nothing was created after this check")
    # The H100 size offered in zones 2 and 3 only, zone 2 taken by a Zone restriction; the login size absent.
    arm_double.scenario.compute_skus = [compute_sku("Standard_ND96isr_H100_v5", loc, "standardNDSH100v5Family", zones=("2", "3"),
                                                    restrictions=[{"type": "Zone", "values": [loc], "reasonCode": "NotAvailableForSubscription",
                                                                   "restrictionInfo": {"locations": [loc], "zones": ["2"]}}])]
    with pytest.raises(RuntimeError) as e:
        ArmCredentialCheckProvider.check_vm_sizes(op, sub, loc, "1", ok)
    msg = str(e.value)
    assert ("tiered:vmSize: Standard_ND96isr_H100_v5 is not offered in zone 1 of 'eastus' (zones it is: 3) "
            "(zones 2 restricted: NotAvailableForSubscription); set tiered:zone to one of them") in msg
    assert "tiered:loginVmSize: Standard_D8s_v5 is not offered in 'eastus' to this subscription" in msg   # both at once
    # Another location's entries do not count (the filter is location eq '<loc>').
    arm_double.scenario.compute_skus = [compute_sku("Standard_ND96isr_H100_v5", "westus3", "f"), compute_sku("Standard_D8s_v5", "westus3", "f")]
    with pytest.raises(RuntimeError, match="Standard_ND96isr_H100_v5 is not offered in 'eastus'"):
        ArmCredentialCheckProvider.check_vm_sizes(op, sub, loc, "1", ok)


def test_a_location_restriction_and_a_missing_read_permission_are_named(arm_double) -> None:  # type: ignore[no-untyped-def]
    from tests.doubles.arm_double import NODE_TOKEN, OPERATOR_TOKEN, compute_sku

    loc, sub = arm_double.location, arm_double.subscription_id
    arm_double.scenario.compute_skus = [compute_sku("Standard_ND96isr_H100_v5", loc, "f", restrictions=[
        {"type": "Location", "values": [loc], "reasonCode": "QuotaId", "restrictionInfo": {"locations": [loc]}}])]
    with pytest.raises(RuntimeError, match=r"Standard_ND96isr_H100_v5 is restricted in 'eastus' for this subscription \(QuotaId\)"):
        ArmCredentialCheckProvider.check_vm_sizes(_client(arm_double, OPERATOR_TOKEN), sub, loc, "1", A100_LOGIN_TL[:0] + [
            {"key": "vmSize", "size": "Standard_ND96isr_H100_v5", "trusted_launch": False}])
    with pytest.raises(RuntimeError) as e:
        ArmCredentialCheckProvider.check_vm_sizes(_client(arm_double, NODE_TOKEN), sub, loc, "1", A100_LOGIN_TL)
    assert "AuthorizationFailed" in str(e.value) and "Microsoft.Compute/skus/read" in str(e.value)


@pytest.mark.parametrize(("stack", "want"), [
    ("dev", [{"key": "vmSize", "size": "Standard_ND96amsr_A100_v4", "trusted_launch": False},
             {"key": "loginVmSize", "size": "Standard_D8s_v5", "trusted_launch": True}]),
    ("prod", [{"key": "vmSize", "size": "Standard_ND96isr_H100_v5", "trusted_launch": True},
              {"key": "loginVmSize", "size": "Standard_D8s_v5", "trusted_launch": True}]),
])
def test_the_program_hands_each_vm_size_and_its_security_type_to_the_preflight(plan, stack: str, want: list) -> None:  # type: ignore[no-untyped-def]
    r = plan(stack)
    [check] = [x for x in r.resources if x.type.endswith("ArmCredentialCheck")]
    assert check.inputs["vms"] == want
    if stack == "dev":
        [none] = [x for x in plan(stack, clusterMode="none").resources if x.type.endswith("ArmCredentialCheck")]
        assert none.inputs.get("vms") in ([], None)             # clusterMode none creates no VM


def test_the_pickled_preflight_checks_vm_sizes_without_the_project_on_the_path(tmp_path: Path) -> None:
    blob = serialize_provider(ArmCredentialCheckProvider())
    code = ("import base64, dill, sys; p = dill.loads(base64.b64decode(sys.stdin.read())); "
            "e = [{'resourceType': 'virtualMachines', 'name': 'Standard_X', 'locations': ['eastus'], "
            "'locationInfo': [{'location': 'eastus', 'zones': ['1']}], 'restrictions': [], "
            "'capabilities': [{'name': 'TrustedLaunchDisabled', 'value': 'True'}]}]; "
            "print(len(p.vm_size_problems(e, 'eastus', '2', [{'key': 'vmSize', 'size': 'Standard_X', 'trusted_launch': True}])))")
    r = subprocess.run([sys.executable, "-c", code], input=blob, capture_output=True, text=True, cwd=tmp_path,
                       env={"PATH": "/usr/bin:/bin"}, timeout=50)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "2"
