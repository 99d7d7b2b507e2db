"""The gate's decision as a pure function: each condition, and what a re-run may accept."""
from __future__ import annotations

from datetime import datetime, timedelta, timezone

from tiered_ops.gate import CheckpointRecord, Evidence, ExportState, ManualArchive, evaluate

T0 = datetime(2026, 11, 29, 12, 0, tzinfo=timezone.utc)
CK = CheckpointRecord("llama", "global_epoch1_step10", T0, (("rank0.bin", 100), ("rank1.bin", 50)), marker_size=300,
                      hashes=(("rank0.bin", "h0"), ("rank1.bin", "h1")))
BLOB_OK = {"llama/global_epoch1_step10/rank0.bin": 100, "llama/global_epoch1_step10/rank1.bin": 50,
           "llama/global_epoch1_step10/COMMITTED.json": 300}


def E(*args, **kw) -> Evidence:  # noqa: ANN002,ANN003
    """Evidence whose blobs carry the exporter's hash of each record's files (content proven),
    unless the test gives its own content evidence."""
    recs = list(kw.get("lustre") or ()) + list(kw.get("blob_checkpoints") or ())
    kw.setdefault("blob_hashes", {f"{r.model}/{r.name}/{p}": h for r in recs for p, h in r.hashes if h})
    return Evidence(*args, **kw)


def healthy(**kw) -> ExportState:
    values = {"state": "InProgress", "admin_status": "Enable", "last_success_utc": T0 + timedelta(minutes=1)}
    values.update(kw)
    return ExportState(**values)


def kinds(ev: Evidence) -> list[str]:
    return [p.kind for p in evaluate(ev).problems]


def test_passes_with_healthy_export_and_every_file_in_blob() -> None:
    r = evaluate(E(True, healthy(), lustre=(CK,), blob=BLOB_OK))
    assert r.ok and r.newest == "llama/global_epoch1_step10" and r.missing_bytes == 0 and r.total_bytes == 150


def test_each_export_condition_fails_on_its_own() -> None:
    assert kinds(E(True, healthy(state="Disabled", admin_status="Disable"), lustre=(CK,), blob=BLOB_OK)) == ["export-state"]
    assert kinds(E(True, healthy(current_iteration_files_failed=1), lustre=(CK,), blob=BLOB_OK)) == ["export-failed-files"]
    assert kinds(E(True, healthy(last_success_utc=T0), lustre=(CK,), blob=BLOB_OK)) == ["export-stale"]   # not after
    assert kinds(E(True, healthy(last_success_utc=None), lustre=(CK,), blob=BLOB_OK)) == ["export-stale"]
    assert kinds(E(True, ExportState("NotFound"), lustre=(CK,), blob=BLOB_OK)) == ["export-missing"]


def test_disabled_is_accepted_only_when_this_teardown_disabled_it() -> None:
    off = healthy(state="Disabled", admin_status="Disable")
    assert evaluate(E(True, off, disabled_by_teardown=True, lustre=(CK,), blob=BLOB_OK)).ok
    # ...and the frozen last-success time must still be after the newest commit.
    late = CheckpointRecord("llama", "global_epoch1_step20", T0 + timedelta(hours=1), (("a", 1),), hashes=(("a", "ha"),))
    ev = E(True, off, disabled_by_teardown=True, lustre=(CK, late),
                  blob={**BLOB_OK, "llama/global_epoch1_step20/a": 1, "llama/global_epoch1_step20/COMMITTED.json": 9})
    assert kinds(ev) == ["export-stale"]


def test_blob_problems_name_checkpoint_file_expected_and_found() -> None:
    blob = dict(BLOB_OK)
    blob["llama/global_epoch1_step10/rank1.bin"] = 49
    del blob["llama/global_epoch1_step10/COMMITTED.json"]
    r = evaluate(E(True, healthy(), lustre=(CK,), blob=blob))
    got = {(p.kind, p.file, p.expected, p.found) for p in r.problems}
    assert got == {("file-missing", "COMMITTED.json", "present", "missing"), ("file-size", "rank1.bin", 50, 49)}
    assert r.missing_bytes == 50
    assert kinds(E(True, healthy(), lustre=(CK,), blob={})) == ["checkpoint-missing"]
    marker_torn = {**BLOB_OK, "llama/global_epoch1_step10/COMMITTED.json": 120}
    assert kinds(E(True, healthy(), lustre=(CK,), blob=marker_torn)) == ["file-size"]


def test_manual_archive_replaces_the_auto_export_counters() -> None:
    stale = healthy(state="Disabled", admin_status="Disable", last_success_utc=T0 - timedelta(hours=1), total_files_failed=4)
    assert evaluate(E(True, stale, manual_archive=ManualArchive(T0 + timedelta(seconds=5), "Completed"),
                             lustre=(CK,), blob=BLOB_OK)).ok
    assert kinds(E(True, stale, manual_archive=ManualArchive(T0 - timedelta(seconds=5), "Completed"),
                          lustre=(CK,), blob=BLOB_OK)) == ["export-stale"]
    assert kinds(E(True, stale, manual_archive=ManualArchive(T0 + timedelta(seconds=5), "Failed"),
                          lustre=(CK,), blob=BLOB_OK)) == ["archive-failed"]


def test_evidence_sources_and_warnings_are_reported() -> None:
    r = evaluate(E(True, healthy(), lustre=(CK,), lustre_uncommitted=("llama/global_epoch1_step30",), blob=BLOB_OK))
    assert r.ok and "llama/global_epoch1_step30" in r.warnings[0]
    r = evaluate(E(True, healthy(), blob=BLOB_OK, blob_checkpoints=(CK,)))
    assert r.ok and "Lustre not scanned" in r.evidence[0]
    r = evaluate(E(True, healthy(), blob=None, blob_checkpoints=()))
    assert r.ok and any("Blob not checked" in e for e in r.evidence)
    # A marker in Blob that does not parse: a problem when nothing else says what it is...
    bad = (("llama/global_epoch1_step40/COMMITTED.json", "does not parse"),)
    assert kinds(E(True, healthy(), blob=BLOB_OK, blob_checkpoints=(CK,), blob_bad_markers=bad)) == ["marker-bad"]
    # ...a warning when Lustre shows that checkpoint is not committed there either.
    r = evaluate(E(True, healthy(), lustre=(CK,), blob=BLOB_OK, blob_bad_markers=bad))
    assert r.ok and "not committed on Lustre" in r.warnings[0]


def test_no_file_system_means_nothing_to_protect() -> None:
    r = evaluate(E(False, None, blob=BLOB_OK, blob_checkpoints=(CK,)))
    assert r.ok and r.newest == "llama/global_epoch1_step10"


def test_without_a_lustre_scan_two_iterations_must_complete_after_the_teardown_began() -> None:
    # From Blob alone a checkpoint whose marker never arrived is invisible, and an iteration that
    # merely *finished* late may have started before it: only an iteration that started after
    # the teardown began (the second one completed since) covers it.
    blob_only = dict(blob=BLOB_OK, blob_checkpoints=(CK,), iteration_baseline=100)
    for count, ok in ((100, False), (101, False), (102, True), (140, True)):
        r = evaluate(E(True, healthy(iteration_count=count), **blob_only))  # type: ignore[arg-type]
        assert r.ok is ok, count
        if not ok:
            assert [p.kind for p in r.problems] == ["export-stale"]
            assert f"{count - 100} of 2 completed" in r.problems[0].message
    # With a Lustre scan too: a checkpoint committed just before the teardown may not be exported yet.
    for count, ok in ((101, False), (102, True)):
        r = evaluate(E(True, healthy(iteration_count=count), lustre=(CK,), blob=BLOB_OK, iteration_baseline=100))
        assert r.ok is ok and (ok or [p.kind for p in r.problems] == ["export-stale"]), count


# Content, not size -------------------------------------------------------------------------------
CK_L = CheckpointRecord("llama", "global_epoch1_step10", T0, (("rank0.bin", 100), ("rank1.bin", 50)), marker_size=300,
                        hashes=(("rank0.bin", "h0"), ("rank1.bin", "h1")), marker_hash="m1")
M = "llama/global_epoch1_step10/"


def test_a_blob_marker_of_the_same_size_but_other_content_is_refused() -> None:
    base = dict(lustre=(CK_L,), blob=BLOB_OK, content={M + "rank0.bin": "h0", M + "rank1.bin": "h1"})
    assert evaluate(Evidence(True, healthy(), blob_marker_hashes={M + "COMMITTED.json": "m1"}, **base)).ok  # type: ignore[arg-type]
    r = evaluate(Evidence(True, healthy(), blob_marker_hashes={M + "COMMITTED.json": "m0"}, **base))  # type: ignore[arg-type]
    assert [(p.kind, p.file, p.expected, p.found) for p in r.problems] == [("marker-differs", "COMMITTED.json", "m1", "m0")]
    r = evaluate(Evidence(True, healthy(), blob_marker_hashes={}, **base))  # type: ignore[arg-type]
    assert [p.kind for p in r.problems] == ["marker-differs"] and "could not be read" in r.problems[0].message


def test_each_content_proof_and_its_failure() -> None:
    markers = {M + "COMMITTED.json": "m1"}

    def gate(**kw):  # noqa: ANN003,ANN202
        return evaluate(Evidence(True, healthy(), lustre=(CK_L,), blob=BLOB_OK, blob_marker_hashes=markers, **kw))

    # The exporter's hash metadata: equal passes, different is another save's upload.
    assert gate(blob_hashes={M + "rank0.bin": "h0", M + "rank1.bin": "h1"}).ok
    r = gate(blob_hashes={M + "rank0.bin": "h0", M + "rank1.bin": "old"})
    assert [(p.kind, p.file) for p in r.problems] == [("file-content", "rank1.bin")] and r.missing_bytes == 50
    # The HSM's own statement: archived passes, dirty (changed since export) does not.
    r = gate(hsm={M + "rank0.bin": "", M + "rank1.bin": ""})
    assert r.ok and "2 file(s) by lfs hsm_state archived of 2" in r.proofs[CK_L.key]
    r = gate(hsm={M + "rank0.bin": "", M + "rank1.bin": "changed since it was exported (dirty)"})
    assert [(p.kind, p.file) for p in r.problems] == [("not-archived", "rank1.bin")]
    # Downloaded content: the strongest proof, it overrides the others.
    r = gate(content={M + "rank0.bin": "h0", M + "rank1.bin": "zeros"}, hsm={M + "rank0.bin": "", M + "rank1.bin": ""})
    assert [(p.kind, p.file, p.found) for p in r.problems] == [("file-content", "rank1.bin", "zeros")]
    # No proof at all: the size alone is not enough.
    r = gate()
    assert {p.kind for p in r.problems} == {"content-unproven"} and "--verify-content" in r.problems[0].message
    assert "no file proven" in r.proofs[CK_L.key]


def test_a_checkpoint_saved_without_hashes_needs_the_hsm() -> None:
    bare = CheckpointRecord("llama", "global_epoch1_step10", T0, (("rank0.bin", 100), ("rank1.bin", 50)), marker_size=300)
    ev = dict(lustre=(bare,), blob=BLOB_OK, blob_hashes={M + "rank0.bin": "h0", M + "rank1.bin": "h1"})
    assert {p.kind for p in evaluate(Evidence(True, healthy(), **ev)).problems} == {"content-unproven"}  # type: ignore[arg-type]
    assert evaluate(Evidence(True, healthy(), hsm={M + "rank0.bin": "", M + "rank1.bin": ""}, **ev)).ok  # type: ignore[arg-type]
