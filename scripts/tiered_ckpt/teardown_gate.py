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
  exist in the data container with the right size.
* without a Lustre scan, a checkpoint whose marker never reached Blob is invisible, and an
  iteration that *finished* after the newest known commit may have *started* before a later
  one: so two iterations must complete after the teardown first looked (the second one then
  started after that moment and walked everything committed before it). Training must be
  stopped before a teardown; the Lustre scan (--lustre-root) needs no such wait.

Which checkpoints exist comes from Lustre when it was scanned (--lustre-root), else from the
markers found in Blob; `GateResult.evidence` says which. All I/O lives in teardown.py.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from datetime import datetime
from typing import Any

MARKER = "COMMITTED.json"


@dataclass(frozen=True)
class CheckpointRecord:
    """A committed checkpoint as one tier shows it."""

    model: str
    name: str
    committed_utc: datetime | None          # Lustre: marker mtime; Blob: manifest created_utc
    files: tuple[tuple[str, int], ...]      # (path relative to the checkpoint dir, size)
    marker_size: int | None = None          # known on Lustre; Blob's marker must match it

    @property
    def key(self) -> str:
        return f"{self.model}/{self.name}"


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


@dataclass(frozen=True)
class Problem:
    kind: str      # export-state | export-stale | export-failed-files | export-missing | archive-failed
    #                | checkpoint-missing | file-missing | file-size | marker-bad
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
    missing_bytes: int = 0                  # bytes of files not (yet) in Blob with the right size
    total_bytes: int = 0

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
        if ma.state != "Completed":
            problems.append(Problem("archive-failed", f"the manual archive ended {ma.state}, not Completed",
                                    expected="Completed", found=ma.state))
        elif newest_t is not None and ma.started_utc <= newest_t:
            problems.append(Problem(
                "export-stale",
                f"the manual archive started {_fmt(ma.started_utc)}, before the newest checkpoint {newest.key if newest else ''} "
                f"was committed ({_fmt(newest_t)})",
                checkpoint=newest.key if newest else None, expected=f"after {_fmt(newest_t)}", found=_fmt(ma.started_utc)))
        return problems, notes

    ex = ev.export
    if ex is None or ex.state == "NotFound":
        problems.append(Problem("export-missing", "the auto-export job could not be found on the file system, so nothing "
                                "proves that Lustre was exported", expected="InProgress", found="not found"))
        return problems, notes
    notes.append(
        f"auto-export: state {ex.state}, admin {ex.admin_status or '?'}, last successful iteration {_fmt(ex.last_success_utc)}, "
        f"failed files total {ex.total_files_failed} / current iteration {ex.current_iteration_files_failed}"
    )
    healthy = ex.state == "InProgress" and ex.admin_status in ("", "Enable")
    ours = ev.disabled_by_teardown and ex.state == "Disabled"
    if not (healthy or ours):
        problems.append(Problem(
            "export-state",
            f"auto-export is {ex.state} (admin {ex.admin_status or '?'}), not InProgress"
            f"{': ' + ex.status_message if ex.status_message else ''}; enable it and let it catch up, or use --manual-export",
            expected="InProgress", found=ex.state))
    if ex.total_files_failed or ex.current_iteration_files_failed:
        problems.append(Problem(
            "export-failed-files",
            f"auto-export reports failed files (total {ex.total_files_failed}, current iteration "
            f"{ex.current_iteration_files_failed}); the failures are listed in the logging container",
            expected=0, found={"total": ex.total_files_failed, "current_iteration": ex.current_iteration_files_failed}))
    if (healthy or ours) and ev.lustre is None and ev.iteration_baseline is None:
        notes.append("a real run (without --lustre-root) also waits for two auto-export iterations that start after it begins")
    if (healthy or ours) and ev.lustre is None and ex.iteration_count is not None and ev.iteration_baseline is not None:
        since = ex.iteration_count - ev.iteration_baseline
        notes.append(f"auto-export iterations completed since this teardown first looked: {since} (2 needed without --lustre-root)")
        if since < 2:
            problems.append(Problem(
                "export-stale",
                f"waiting for an auto-export iteration that started after this teardown began ({since} of 2 completed "
                "since): without --lustre-root only such an iteration proves that checkpoints whose markers are not in "
                "Blob yet were exported; make sure training has stopped",
                expected=2, found=since))
    if newest is not None and newest_t is not None:
        if ex.last_success_utc is None or ex.last_success_utc <= newest_t:
            problems.append(Problem(
                "export-stale",
                f"the last successful auto-export iteration finished {_fmt(ex.last_success_utc)}, not after the newest "
                f"checkpoint {newest.key} was committed ({_fmt(newest_t)})",
                checkpoint=newest.key, expected=f"after {_fmt(newest_t)}", found=_fmt(ex.last_success_utc)))
    return problems, notes


def _blob_problems(expected: tuple[CheckpointRecord, ...], blob: dict[str, int]) -> tuple[list[Problem], int, int]:
    problems: list[Problem] = []
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
        if marker is None:
            problems.append(Problem("file-missing", f"{rec.key}/{MARKER} (the commit marker) is not in Blob",
                                    checkpoint=rec.key, file=MARKER, expected="present", found="missing"))
        elif rec.marker_size is not None and marker != rec.marker_size:
            problems.append(Problem("file-size", f"{rec.key}/{MARKER}: {marker} bytes in Blob, {rec.marker_size} on Lustre",
                                    checkpoint=rec.key, file=MARKER, expected=rec.marker_size, found=marker))
        for path, size in rec.files:
            got = blob.get(base + path)
            if got is None:
                problems.append(Problem("file-missing", f"{rec.key}/{path} is not in Blob ({size} bytes expected)",
                                        checkpoint=rec.key, file=path, expected=size, found=None))
                missing_bytes += size
            elif got != size:
                problems.append(Problem("file-size", f"{rec.key}/{path}: {got} bytes in Blob, the manifest says {size}",
                                        checkpoint=rec.key, file=path, expected=size, found=got))
                missing_bytes += size
    return problems, missing_bytes, total


def evaluate(ev: Evidence) -> GateResult:
    """Pass only when every committed checkpoint is provably in the archive."""
    if not ev.compute_present:
        newest_blob = _newest(ev.blob_checkpoints)
        return GateResult(
            ok=True, problems=(), checkpoints=tuple(r.key for r in ev.blob_checkpoints),
            evidence=("the stack has no file system any more (compute side off): nothing is left on Lustre to protect",),
            newest=newest_blob.key if newest_blob else None,
            newest_committed_utc=newest_blob.committed_utc if newest_blob else None,
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
    if ev.blob is not None:
        evidence.append(f"Blob listed: {len(ev.blob)} blob(s) under the checkpoint prefix, sizes compared with each manifest")
        bp, missing_bytes, total = _blob_problems(expected, ev.blob)
        problems.extend(bp)
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
    )
