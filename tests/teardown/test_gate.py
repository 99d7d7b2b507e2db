"""The gate's decision as a pure function: each condition, and what a re-run may accept."""
from __future__ import annotations

from datetime import datetime, timedelta, timezone

from tiered_ckpt.teardown_gate import CheckpointRecord, Evidence, ExportState, ManualArchive, evaluate

T0 = datetime(2026, 11, 29, 12, 0, tzinfo=timezone.utc)
CK = CheckpointRecord("llama", "global_epoch1_step10", T0, (("rank0.bin", 100), ("rank1.bin", 50)), marker_size=300)
BLOB_OK = {"llama/global_epoch1_step10/rank0.bin": 100, "llama/global_epoch1_step10/rank1.bin": 50,
           "llama/global_epoch1_step10/COMMITTED.json": 300}


def healthy(**kw) -> ExportState:
    values = {"state": "InProgress", "admin_status": "Enable", "last_success_utc": T0 + timedelta(minutes=1)}
    values.update(kw)
    return ExportState(**values)


def kinds(ev: Evidence) -> list[str]:
    return [p.kind for p in evaluate(ev).problems]


def test_passes_with_healthy_export_and_every_file_in_blob() -> None:
    r = evaluate(Evidence(True, healthy(), lustre=(CK,), blob=BLOB_OK))
    assert r.ok and r.newest == "llama/global_epoch1_step10" and r.missing_bytes == 0 and r.total_bytes == 150


def test_each_export_condition_fails_on_its_own() -> None:
    assert kinds(Evidence(True, healthy(state="Disabled", admin_status="Disable"), lustre=(CK,), blob=BLOB_OK)) == ["export-state"]
    assert kinds(Evidence(True, healthy(current_iteration_files_failed=1), lustre=(CK,), blob=BLOB_OK)) == ["export-failed-files"]
    assert kinds(Evidence(True, healthy(last_success_utc=T0), lustre=(CK,), blob=BLOB_OK)) == ["export-stale"]   # not after
    assert kinds(Evidence(True, healthy(last_success_utc=None), lustre=(CK,), blob=BLOB_OK)) == ["export-stale"]
    assert kinds(Evidence(True, ExportState("NotFound"), lustre=(CK,), blob=BLOB_OK)) == ["export-missing"]


def test_disabled_is_accepted_only_when_this_teardown_disabled_it() -> None:
    off = healthy(state="Disabled", admin_status="Disable")
    assert evaluate(Evidence(True, off, disabled_by_teardown=True, lustre=(CK,), blob=BLOB_OK)).ok
    # ...and the frozen last-success time must still be after the newest commit.
    late = CheckpointRecord("llama", "global_epoch1_step20", T0 + timedelta(hours=1), (("a", 1),))
    ev = Evidence(True, off, disabled_by_teardown=True, lustre=(CK, late),
                  blob={**BLOB_OK, "llama/global_epoch1_step20/a": 1, "llama/global_epoch1_step20/COMMITTED.json": 9})
    assert kinds(ev) == ["export-stale"]


def test_blob_problems_name_checkpoint_file_expected_and_found() -> None:
    blob = dict(BLOB_OK)
    blob["llama/global_epoch1_step10/rank1.bin"] = 49
    del blob["llama/global_epoch1_step10/COMMITTED.json"]
    r = evaluate(Evidence(True, healthy(), lustre=(CK,), blob=blob))
    got = {(p.kind, p.file, p.expected, p.found) for p in r.problems}
    assert got == {("file-missing", "COMMITTED.json", "present", "missing"), ("file-size", "rank1.bin", 50, 49)}
    assert r.missing_bytes == 50
    assert kinds(Evidence(True, healthy(), lustre=(CK,), blob={})) == ["checkpoint-missing"]
    marker_torn = {**BLOB_OK, "llama/global_epoch1_step10/COMMITTED.json": 120}
    assert kinds(Evidence(True, healthy(), lustre=(CK,), blob=marker_torn)) == ["file-size"]


def test_manual_archive_replaces_the_auto_export_counters() -> None:
    stale = healthy(state="Disabled", admin_status="Disable", last_success_utc=T0 - timedelta(hours=1), total_files_failed=4)
    assert evaluate(Evidence(True, stale, manual_archive=ManualArchive(T0 + timedelta(seconds=5), "Completed"),
                             lustre=(CK,), blob=BLOB_OK)).ok
    assert kinds(Evidence(True, stale, manual_archive=ManualArchive(T0 - timedelta(seconds=5), "Completed"),
                          lustre=(CK,), blob=BLOB_OK)) == ["export-stale"]
    assert kinds(Evidence(True, stale, manual_archive=ManualArchive(T0 + timedelta(seconds=5), "Failed"),
                          lustre=(CK,), blob=BLOB_OK)) == ["archive-failed"]


def test_evidence_sources_and_warnings_are_reported() -> None:
    r = evaluate(Evidence(True, healthy(), lustre=(CK,), lustre_uncommitted=("llama/global_epoch1_step30",), blob=BLOB_OK))
    assert r.ok and "llama/global_epoch1_step30" in r.warnings[0]
    r = evaluate(Evidence(True, healthy(), blob=BLOB_OK, blob_checkpoints=(CK,)))
    assert r.ok and "Lustre not scanned" in r.evidence[0]
    r = evaluate(Evidence(True, healthy(), blob=None, blob_checkpoints=()))
    assert r.ok and any("Blob not checked" in e for e in r.evidence)
    # A marker in Blob that does not parse: a problem when nothing else says what it is...
    bad = (("llama/global_epoch1_step40/COMMITTED.json", "does not parse"),)
    assert kinds(Evidence(True, healthy(), blob=BLOB_OK, blob_checkpoints=(CK,), blob_bad_markers=bad)) == ["marker-bad"]
    # ...a warning when Lustre shows that checkpoint is not committed there either.
    r = evaluate(Evidence(True, healthy(), lustre=(CK,), blob=BLOB_OK, blob_bad_markers=bad))
    assert r.ok and "not committed on Lustre" in r.warnings[0]


def test_no_file_system_means_nothing_to_protect() -> None:
    r = evaluate(Evidence(False, None, blob=BLOB_OK, blob_checkpoints=(CK,)))
    assert r.ok and r.newest == "llama/global_epoch1_step10"


def test_without_a_lustre_scan_two_iterations_must_complete_after_the_teardown_began() -> None:
    # From Blob alone a checkpoint whose marker never arrived is invisible, and an iteration that
    # merely *finished* late may have started before it: only an iteration that started after
    # the teardown began (the second one completed since) covers it.
    blob_only = dict(blob=BLOB_OK, blob_checkpoints=(CK,), iteration_baseline=100)
    for count, ok in ((100, False), (101, False), (102, True), (140, True)):
        r = evaluate(Evidence(True, healthy(iteration_count=count), **blob_only))  # type: ignore[arg-type]
        assert r.ok is ok, count
        if not ok:
            assert [p.kind for p in r.problems] == ["export-stale"]
            assert f"{count - 100} of 2 completed" in r.problems[0].message
    # A Lustre scan names every committed checkpoint: no wait for iterations.
    assert evaluate(Evidence(True, healthy(iteration_count=100), lustre=(CK,), blob=BLOB_OK, iteration_baseline=100)).ok
