"""`location` is checked against the subscription's own AMLFS SKU list before the file system exists."""
from __future__ import annotations

import base64
import subprocess
import sys
from pathlib import Path

import pytest
from pulumi.dynamic.dynamic import serialize_provider

from components.blob_jobs import ArmCredentialCheckProvider
from components.regions import offering_locations, region_problem


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
