"""The blob-integration job states are the REST spec's enums, defined once (tiered_ckpt.tiers.arm_model).

azure-mgmt-storagecache's models are generated from the Microsoft.StorageCache REST spec
(amlfilesystem.json), so its enums are the spec's state lists.
"""
from __future__ import annotations

from azure.mgmt.storagecache.models import (
    ArchiveStatusType,
    AutoExportJobAdminStatus,
    AutoExportStatusType,
    ImportStatusType,
)

from tiered_ckpt.tiers import arm_model as m


def values(enum: type) -> set[str]:
    return {e.value for e in enum}  # type: ignore[attr-defined]


def test_import_states_split_the_spec_enum_into_busy_and_terminal() -> None:
    assert set(m.IMPORT_BUSY) | set(m.IMPORT_TERMINAL) == values(ImportStatusType)
    assert not set(m.IMPORT_BUSY) & set(m.IMPORT_TERMINAL)
    assert m.IMPORT_COMPLETED in m.IMPORT_TERMINAL and m.IMPORT_IN_PROGRESS in m.IMPORT_BUSY


def test_archive_states_split_the_spec_enum_into_busy_and_terminal() -> None:
    assert set(m.ARCHIVE_BUSY) | set(m.ARCHIVE_TERMINAL) == values(ArchiveStatusType)
    assert not set(m.ARCHIVE_BUSY) & set(m.ARCHIVE_TERMINAL)
    assert {m.ARCHIVE_COMPLETED, m.ARCHIVE_IDLE, *m.ARCHIVE_ENDED_BADLY} <= set(m.ARCHIVE_TERMINAL)


def test_autoexport_states_and_admin_values_are_the_spec_enums() -> None:
    named = {m.AUTOEXPORT_RUNNING, m.AUTOEXPORT_DISABLING, m.AUTOEXPORT_DISABLED, *m.AUTOEXPORT_STOP_FAILED}
    assert named == values(AutoExportStatusType)
    assert {m.ADMIN_ENABLE, m.ADMIN_DISABLE} == values(AutoExportJobAdminStatus)


def test_the_sdk_enum_parses_to_its_wire_value() -> None:
    assert m.wire(ImportStatusType.COMPLETED_PARTIAL) == "CompletedPartial" and m.wire(None) == ""
