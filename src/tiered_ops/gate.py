"""The teardown gate: may the file system go? A pure decision over plain evidence.

Deleting AMLFS loses every file that is not in Blob. The gate passes only when the archive
provably holds every committed checkpoint (Microsoft's guidance before deleting a file system:
last successful export iteration recent, zero failed files, then disable auto-export):

* export: auto-export is InProgress (enabled, healthy), its last successful iteration finished
  after the newest checkpoint was committed, and no file failed (total and current iteration);
  or a manual archive of the checkpoint prefix, started after the newest commit, Completed.
  On a re-run after this teardown disabled auto-export, Disabled is accepted (the journal says
  so) and the frozen last-success time must still be after the newest commit.
* blob (when checked): every committed checkpoint's marker and every file its manifest names
  exist in the data container with the right size, and with the right *content* (a blob of the
  right size may be an older save of the same name, or zeros):
  - the marker: with a Lustre scan, the Blob marker's bytes hash to the Lustre marker's hash
    (markers are small; both are read). Without one, the Blob marker is the reference.
  - each file, by the first proof available: its downloaded content hashes to the manifest's
    xxh3-128 (--verify-content); or the exporter's xxh3 metadata on the blob equals the
    manifest's (the local exporter writes it with the upload; AMLFS auto-export writes none);
    or `lfs hsm_state` says exists + archived and not dirty/lost (the HSM's own statement that
    the archived copy is the current content; needs --lustre-root). A file with none of these
    is "content-unproven" and the gate fails. `GateResult.proofs` says which proof was used
    for each checkpoint.
* an iteration that *finished* after the newest known commit may have *started* before it (and
  without a Lustre scan, a checkpoint whose marker never reached Blob is invisible): so two
  iterations must complete after the teardown first looked (the second one then started after
  that moment and walked everything committed before it), with or without --lustre-root.
  Training must be stopped before a teardown.

Which checkpoints exist comes from Lustre when it was scanned (--lustre-root), else from the
markers found in Blob; `GateResult.evidence` says which. All I/O lives in tiered_ops/evidence.py.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from datetime import datetime
from typing import Any

from tiered_ckpt.io.marker import MARKER
from tiered_ckpt.tiers.arm_model import ADMIN_ENABLE, ARCHIVE_COMPLETED, AUTOEXPORT_DISABLED, AUTOEXPORT_RUNNING

# ExportState.state when ARM has no auto-export job by that name (not an ARM state: a 404).
EXPORT_NOT_FOUND = "NotFound"


@dataclass(frozen=True)
class CheckpointRecord:
    """A committed checkpoint as one tier shows it."""

    model: str
    name: str
    committed_utc: datetime | None          # Lustre: marker mtime; Blob: manifest created_utc
    files: tuple[tuple[str, int], ...]      # (path relative to the checkpoint dir, size)
    marker_size: int | None = None          # known on Lustre; Blob's marker must match it
    # (path, xxh3-128 the manifest names for it; None: saved without hashes)
    hashes: tuple[tuple[str, str | None], ...] = ()
    marker_hash: str | None = None          # xxh3-128 of the marker's bytes on Lustre

    @property
    def key(self) -> str:
        return f"{self.model}/{self.name}"

    def hash_of(self, path: str) -> str | None:
        return dict(self.hashes).get(path)


@dataclass(frozen=True)
class ExportState:
    """Auto-export as ARM reports it (None fields when the job could not be read)."""

    state: str                              # InProgress | Disabling | Disabled | DisableFailed | Failed | NotFound
    admin_status: str = ""
    last_success_utc: datetime | None = None
    total_files_failed: int = 0
    current_iteration_files_failed: int = 0
    status_message: str = ""
    iteration_count: int | None = None      # exportIterationCount: iterations completed since the job started


@dataclass(frozen=True)
class ManualArchive:
    started_utc: datetime
    state: str                              # Completed | Failed | ... (ArchiveStatusType)


@dataclass(frozen=True)
class Evidence:
    compute_present: bool                   # the stack still has a file system
    export: ExportState | None              # None: not read (compute gone)
    disabled_by_teardown: bool = False      # the journal: this teardown disabled auto-export
    manual_archive: ManualArchive | None = None
    lustre: tuple[CheckpointRecord, ...] | None = None   # None: Lustre not scanned
    lustre_uncommitted: tuple[str, ...] = ()
    blob: dict[str, int] | None = None      # blob path relative to the checkpoint prefix -> size; None: not checked
    blob_checkpoints: tuple[CheckpointRecord, ...] = ()  # markers that parse in Blob
    blob_bad_markers: tuple[tuple[str, str], ...] = ()   # (marker path, why it does not count)
    # exportIterationCount when this teardown first looked (kept in its journal across re-runs).
    iteration_baseline: int | None = None
    # Content evidence, keyed like `blob` (path relative to the checkpoint prefix):
    blob_hashes: dict[str, str] = field(default_factory=dict)         # the exporter's xxh3 metadata, where present
    blob_marker_hashes: dict[str, str | None] = field(default_factory=dict)  # xxh3 of the Blob marker's bytes
    hsm: dict[str, str] | None = None       # "" = exists+archived, clean; else why not. None: not read
    hsm_note: str = ""                      # why the HSM state was not read
    content: dict[str, str] | None = None   # xxh3 of the downloaded blob (--verify-content); None: not downloaded


@dataclass(frozen=True)
class Problem:
    kind: str      # export-state | export-stale | export-failed-files | export-missing | archive-failed
    #                | checkpoint-missing | file-missing | file-size | marker-bad | marker-differs
    #                | file-content | not-archived | content-unproven
    message: str
    checkpoint: str | None = None
    file: str | None = None
    expected: Any = None
    found: Any = None


@dataclass(frozen=True)
class GateResult:
    ok: bool
    problems: tuple[Problem, ...]
    evidence: tuple[str, ...]               # sentences: what was checked, from which source
    checkpoints: tuple[str, ...]            # model/name of every committed checkpoint considered
    newest: str | None
    newest_committed_utc: datetime | None
    warnings: tuple[str, ...] = ()
    missing_bytes: int = 0                  # bytes of files not (yet) proven in Blob
    total_bytes: int = 0
    proofs: dict[str, str] = field(default_factory=dict)   # checkpoint -> which content proof was used
    committed_utc: dict[str, datetime | None] = field(default_factory=dict)   # checkpoint -> its commit time

    def to_json(self) -> dict[str, Any]:
        return {
            "ok": self.ok,
            "problems": [asdict(p) for p in self.problems],
            "evidence": list(self.evidence),
            "checkpoints": list(self.checkpoints),
            "newest": self.newest,
            "newest_committed_utc": self.newest_committed_utc.isoformat() if self.newest_committed_utc else None,
            "warnings": list(self.warnings),
            "missing_bytes": self.missing_bytes,
            "total_bytes": self.total_bytes,
            "proofs": dict(self.proofs),
        }


def _fmt(t: datetime | None) -> str:
    return t.isoformat(timespec="seconds") if t else "never"


def _newest(records: tuple[CheckpointRecord, ...]) -> CheckpointRecord | None:
    dated = [r for r in records if r.committed_utc is not None]
    return max(dated, key=lambda r: r.committed_utc) if dated else None  # type: ignore[arg-type,return-value]


def _export_problems(ev: Evidence, newest: CheckpointRecord | None) -> tuple[list[Problem], list[str]]:
    problems: list[Problem] = []
    notes: list[str] = []
    newest_t = newest.committed_utc if newest else None
    ma = ev.manual_archive
    if ma is not None:
        notes.append(f"manual archive of the checkpoint prefix started {_fmt(ma.started_utc)}: {ma.state}")
        if ma.state != ARCHIVE_COMPLETED:
            problems.append(Problem("archive-failed", f"the manual archive ended {ma.state}, not {ARCHIVE_COMPLETED}",
                                    expected=ARCHIVE_COMPLETED, found=ma.state))
        elif newest_t is not None and ma.started_utc <= newest_t:
            problems.append(Problem(
                "export-stale",
                f"the manual archive started {_fmt(ma.started_utc)}, before the newest checkpoint {newest.key if newest else ''} "
                f"was committed ({_fmt(newest_t)})",
                checkpoint=newest.key if newest else None, expected=f"after {_fmt(newest_t)}", found=_fmt(ma.started_utc)))
        return problems, notes

    ex = ev.export
    if ex is None or ex.state == EXPORT_NOT_FOUND:
        problems.append(Problem("export-missing", "the auto-export job could not be found on the file system, so nothing "
                                "proves that Lustre was exported", expected=AUTOEXPORT_RUNNING, found="not found"))
        return problems, notes
    notes.append(
        f"auto-export: state {ex.state}, admin {ex.admin_status or '?'}, last successful iteration {_fmt(ex.last_success_utc)}, "
        f"failed files total {ex.total_files_failed} / current iteration {ex.current_iteration_files_failed}"
    )
    healthy = ex.state == AUTOEXPORT_RUNNING and ex.admin_status in ("", ADMIN_ENABLE)
    ours = ev.disabled_by_teardown and ex.state == AUTOEXPORT_DISABLED
    if not (healthy or ours):
        problems.append(Problem(
            "export-state",
            f"auto-export is {ex.state} (admin {ex.admin_status or '?'}), not {AUTOEXPORT_RUNNING}"
            f"{': ' + ex.status_message if ex.status_message else ''}; enable it and let it catch up, or use --manual-export",
            expected=AUTOEXPORT_RUNNING, found=ex.state))
    if ex.total_files_failed or ex.current_iteration_files_failed:
        problems.append(Problem(
            "export-failed-files",
            f"auto-export reports failed files (total {ex.total_files_failed}, current iteration "
            f"{ex.current_iteration_files_failed}); the failures are listed in the logging container",
            expected=0, found={"total": ex.total_files_failed, "current_iteration": ex.current_iteration_files_failed}))
    if (healthy or ours) and ev.iteration_baseline is None:
        notes.append("a real run also waits for two auto-export iterations that start after it begins")
    if (healthy or ours) and ex.iteration_count is not None and ev.iteration_baseline is not None:
        since = ex.iteration_count - ev.iteration_baseline
        notes.append(f"auto-export iterations completed since this teardown first looked: {since} (2 needed)")
        if since < 2:
            problems.append(Problem(
                "export-stale",
                f"waiting for an auto-export iteration that started after this teardown began ({since} of 2 completed "
                "since): only such an iteration has walked every checkpoint committed before the teardown (one "
                "committed just before it may not be exported yet, and without --lustre-root one whose marker is not "
                "in Blob is invisible); make sure training has stopped",
                expected=2, found=since))
    if newest is not None and newest_t is not None:
        if ex.last_success_utc is None or ex.last_success_utc <= newest_t:
            problems.append(Problem(
                "export-stale",
                f"the last successful auto-export iteration finished {_fmt(ex.last_success_utc)}, not after the newest "
                f"checkpoint {newest.key} was committed ({_fmt(newest_t)})",
                checkpoint=newest.key, expected=f"after {_fmt(newest_t)}", found=_fmt(ex.last_success_utc)))
    return problems, notes


def _content(ev: Evidence, rec: CheckpointRecord, key: str, path: str) -> tuple[str | None, Problem | None]:
    """(the proof used, or the problem) for one file already present with the right size."""
    want = rec.hash_of(path)
    if ev.content is not None and key in ev.content:
        if want is None:
            return None, Problem("content-unproven", f"{rec.key}/{path}: downloaded, but the manifest names no hash "
                                 "(saved with hash=False) and no Lustre copy was hashed to compare with",
                                 checkpoint=rec.key, file=path, expected="a hash", found=None)
        if ev.content[key] != want:
            return None, Problem("file-content", f"{rec.key}/{path}: the blob's content (xxh3 {ev.content[key]}) is not "
                                 f"the committed file's (xxh3 {want}): Blob holds other bytes of the same size",
                                 checkpoint=rec.key, file=path, expected=want, found=ev.content[key])
        return "downloaded content hash", None
    meta = ev.blob_hashes.get(key)
    if meta is not None and want is not None:
        if meta != want:
            return None, Problem("file-content", f"{rec.key}/{path}: the blob was uploaded from other content (exporter "
                                 f"xxh3 {meta}, the manifest says {want}): an older or other save of this name",
                                 checkpoint=rec.key, file=path, expected=want, found=meta)
        return "exporter xxh3 metadata", None
    if ev.hsm is not None and key in ev.hsm:
        why = ev.hsm[key]
        if why:
            return None, Problem("not-archived", f"{rec.key}/{path} on Lustre: {why}; the blob of that name is not "
                                 "(yet) its current content", checkpoint=rec.key, file=path, expected="archived", found=why)
        return "lfs hsm_state archived", None
    how = ("pass --verify-content to download and hash it" if ev.lustre is None and ev.hsm is None else
           "pass --verify-content to download and hash it, or run with --lustre-root on a node where lfs works")
    return None, Problem("content-unproven", f"{rec.key}/{path}: the blob has the right size but nothing proves its "
                         f"content (no exporter hash metadata{', no HSM state' if ev.hsm is None else ''}); {how}",
                         checkpoint=rec.key, file=path, expected="proof", found=None)


def _blob_problems(expected: tuple[CheckpointRecord, ...], blob: dict[str, int],
                   ev: Evidence | None = None) -> tuple[list[Problem], int, int, dict[str, str]]:
    ev = ev if ev is not None else Evidence(True, None, blob=blob)
    problems: list[Problem] = []
    proofs: dict[str, str] = {}
    missing_bytes = total = 0
    for rec in expected:
        base = f"{rec.model}/{rec.name}/"
        marker = blob.get(base + MARKER)
        absent = [(p, s) for p, s in rec.files if blob.get(base + p) is None]
        total += sum(s for _, s in rec.files)
        if marker is None and len(absent) == len(rec.files):
            problems.append(Problem("checkpoint-missing", f"checkpoint {rec.key} is not in Blob at all (no marker, none of its "
                                    f"{len(rec.files)} files)", checkpoint=rec.key, expected=len(rec.files) + 1, found=0))
            missing_bytes += sum(s for _, s in rec.files)
            continue
        used: dict[str, int] = {}
        if marker is None:
            problems.append(Problem("file-missing", f"{rec.key}/{MARKER} (the commit marker) is not in Blob",
                                    checkpoint=rec.key, file=MARKER, expected="present", found="missing"))
        elif rec.marker_size is not None and marker != rec.marker_size:
            problems.append(Problem("file-size", f"{rec.key}/{MARKER}: {marker} bytes in Blob, {rec.marker_size} on Lustre",
                                    checkpoint=rec.key, file=MARKER, expected=rec.marker_size, found=marker))
        elif rec.marker_hash is not None:
            got = ev.blob_marker_hashes.get(base + MARKER)
            if got != rec.marker_hash:
                problems.append(Problem(
                    "marker-differs",
                    f"{rec.key}/{MARKER} in Blob is not the marker on Lustre ("
                    + ("it could not be read" if got is None else f"same size, other content: xxh3 {got}, Lustre's {rec.marker_hash}")
                    + "): Blob holds another save of this name, and restore would read that one",
                    checkpoint=rec.key, file=MARKER, expected=rec.marker_hash, found=got))
        for path, size in rec.files:
            got_size = blob.get(base + path)
            if got_size is None:
                problems.append(Problem("file-missing", f"{rec.key}/{path} is not in Blob ({size} bytes expected)",
                                        checkpoint=rec.key, file=path, expected=size, found=None))
                missing_bytes += size
                continue
            if got_size != size:
                problems.append(Problem("file-size", f"{rec.key}/{path}: {got_size} bytes in Blob, the manifest says {size}",
                                        checkpoint=rec.key, file=path, expected=size, found=got_size))
                missing_bytes += size
                continue
            proof, problem = _content(ev, rec, base + path, path)
            if problem is not None:
                problems.append(problem)
                missing_bytes += size
            else:
                assert proof is not None
                used[proof] = used.get(proof, 0) + 1
        marker_how = ("marker identical to Lustre's (xxh3 of its bytes)" if rec.marker_hash is not None
                      else "marker as found in Blob (the reference)")
        files_how = ", ".join(f"{n} file(s) by {how}" for how, n in sorted(used.items())) or "no file proven"
        proofs[rec.key] = f"{marker_how}; {files_how} of {len(rec.files)}"
    return problems, missing_bytes, total, proofs


def evaluate(ev: Evidence) -> GateResult:
    """Pass only when every committed checkpoint is provably in the archive."""
    if not ev.compute_present:
        newest_blob = _newest(ev.blob_checkpoints)
        return GateResult(
            ok=True, problems=(), checkpoints=tuple(r.key for r in ev.blob_checkpoints),
            evidence=("the stack has no file system any more (compute side off): nothing is left on Lustre to protect",),
            newest=newest_blob.key if newest_blob else None,
            newest_committed_utc=newest_blob.committed_utc if newest_blob else None,
            committed_utc={r.key: r.committed_utc for r in ev.blob_checkpoints},
        )
    evidence: list[str] = []
    warnings: list[str] = []
    if ev.lustre is not None:
        expected = ev.lustre
        evidence.append(f"Lustre scanned: {len(expected)} committed checkpoint(s) found by their markers")
        if ev.lustre_uncommitted:
            warnings.append("not committed on Lustre (in flight or torn; they are not checkpoints and will be lost): "
                            + ", ".join(ev.lustre_uncommitted))
    else:
        expected = ev.blob_checkpoints
        evidence.append(
            f"Lustre not scanned (no --lustre-root): the {len(expected)} checkpoint(s) whose markers are in Blob, plus the "
            "auto-export counters; a checkpoint committed on Lustre whose marker never reached Blob is only covered by "
            "the 'last successful iteration after the newest commit' condition"
        )
    newest = _newest(expected)
    problems, notes = _export_problems(ev, newest)
    evidence.extend(notes)
    missing_bytes = total = 0
    proofs: dict[str, str] = {}
    if ev.blob is not None:
        evidence.append(f"Blob listed: {len(ev.blob)} blob(s) under the checkpoint prefix, sizes compared with each manifest")
        evidence.append(
            "content: "
            + ("every file downloaded and hashed (--verify-content)" if ev.content is not None else
               "exporter xxh3 metadata where present"
               + (", else lfs hsm_state (archived, not dirty/lost)" if ev.hsm is not None else "")
               + (f"; HSM state not read: {ev.hsm_note}" if ev.hsm is None and ev.hsm_note else "")))
        bp, missing_bytes, total, proofs = _blob_problems(expected, ev.blob, ev)
        problems.extend(bp)
        evidence.extend(f"{key}: {how}" for key, how in proofs.items())
        keys = {r.key for r in expected}
        for path, why in ev.blob_bad_markers:
            key = path.rsplit("/", 1)[0]
            msg = f"{path} in Blob {why}; restore cannot use that checkpoint from Blob"
            if ev.lustre is None or key in keys:
                problems.append(Problem("marker-bad", msg, checkpoint=key, file=MARKER, found=why))
            else:
                warnings.append(msg + " (it is not committed on Lustre either)")
    else:
        evidence.append("Blob not checked (--no-blob-check): the gate relies on the auto-export counters alone")
    return GateResult(
        ok=not problems,
        problems=tuple(problems),
        evidence=tuple(evidence),
        checkpoints=tuple(r.key for r in expected),
        newest=newest.key if newest else None,
        newest_committed_utc=newest.committed_utc if newest else None,
        warnings=tuple(warnings),
        missing_bytes=missing_bytes,
        total_bytes=total,
        proofs=proofs,
        committed_utc={r.key: r.committed_utc for r in expected},
    )
