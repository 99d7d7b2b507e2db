"""The archive's redundancy: prod's storage account is zone-redundant by default (the only durable copy of
every checkpoint must outlive a zone outage; AMLFS blob integration supports ZRS), LRS only when asked."""
from __future__ import annotations

from tests.infra.conftest import Plan

T = "azure-native:"


def test_prod_archive_is_zone_redundant_by_default_and_lrs_only_on_request(plan: Plan) -> None:
    acct = plan("prod").one(T + "storage:StorageAccount", "archive")
    assert acct.inputs["sku"]["name"] == "Standard_ZRS"
    acct = plan("prod", storageSku="Standard_LRS").one(T + "storage:StorageAccount", "archive")
    assert acct.inputs["sku"]["name"] == "Standard_LRS"
