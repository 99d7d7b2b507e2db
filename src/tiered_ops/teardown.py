"""Scripted teardown between training campaigns: prove the archive, then remove the compute side.

    outputs -> gate (wait / manual export) -> disable auto-export -> computeEnabled=false -> pulumi up

The decision is teardown_gate.evaluate (pure); this module gathers its evidence (ARM, Blob,
optionally a Lustre mount), runs the steps, and keeps a small journal so that a re-run after an
interruption continues safely. The archive (storage account, containers) stays under Pulumi's
management; deleting it is the separate `delete_archive` command. docs/teardown.md explains.
"""
from __future__ import annotations

import json
import os
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from tiered_ckpt.cli.output import byte_progress, human_bytes, redact
from tiered_ckpt.errors import EXIT_FAILED, ConfigError, UserError
from tiered_ckpt.io import commit as mf
from tiered_ckpt.io import fsafe
from tiered_ckpt.io.hashing import hash_file, new_hasher
from tiered_ckpt.tiers.arm import AmlfsJobs, AmlfsTarget, ArchiveProgress, ArmNotFoundError
from tiered_ops.gate import CheckpointRecord, Evidence, ExportState, GateResult, ManualArchive, evaluate
from tiered_ops.pulumi_cli import PulumiCli

COMPUTE_KEY = "tiered:computeEnabled"


class Refused(UserError):
    """The gate (or the operator) said no; nothing was changed. `.result` is the --json report."""

    exit_code = EXIT_FAILED

    def __init__(self, message: str, *, result: dict[str, Any] | None = None, exit_code: int | None = None) -> None:
        super().__init__(message, exit_code=exit_code)
        self.result = result or {}


# ---------------------------------------------------------------------------------------------
# Plain data


@dataclass(frozen=True)
class Options:
    stack: str
    project_dir: Path
    state_dir: Path
    dry_run: bool = False
    yes: bool = False
    force: bool = False
    as_json: bool = False
    wait_timeout: float = 1800.0
    poll_interval: float = 30.0
    manual_export: bool = False
    lustre_root: Path | None = None
    blob_check: bool = True
    connection_string: str | None = None
    arm_endpoint: str | None = None
    disable_timeout: float = 1800.0
    verify_content: bool = False        # download and hash every file of every checkpoint
    lfs: str = "lfs"                    # the lfs binary for `lfs hsm_state` (with lustre_root)
    download_concurrency: int = 8


@dataclass(frozen=True)
class StackOutputs:
    raw: dict[str, Any]

    def get(self, key: str) -> Any:
        return self.raw.get(key)

    @property
    def compute_present(self) -> bool:
        return bool(self.raw.get("amlfsName")) and self.raw.get("computeEnabled") is not False

    @property
    def prefix(self) -> str:
        """Absolute checkpoint prefix, e.g. /checkpoints (a path in Lustre and, without the '/', in Blob)."""
        p = str(self.raw.get("checkpointPrefix") or "/checkpoints")
        return "/" + p.strip("/")

    def require(self, *keys: str) -> None:
        missing = [k for k in keys if self.raw.get(k) in (None, "")]
        if missing:
            raise ConfigError(
                f"the stack outputs lack {', '.join(missing)}; this stack was not deployed by this project's program "
                "(or its last `pulumi up` failed): check `pulumi stack output --json --stack <stack>`"
            )

    def target(self, endpoint: str | None) -> AmlfsTarget:
        self.require("subscriptionId", "computeResourceGroup", "amlfsName", "autoExportJobName")
        return AmlfsTarget(
            subscription_id=str(self.raw["subscriptionId"]),
            resource_group=str(self.raw["computeResourceGroup"]),
            filesystem=str(self.raw["amlfsName"]),
            autoexport_job=str(self.raw["autoExportJobName"]),
            endpoint=endpoint,
        )


@dataclass
class Journal:
    """.teardown/<stack>.json: which steps of this teardown are done (re-runs continue from it)."""

    path: Path
    data: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def load(cls, state_dir: Path, stack: str) -> Journal:
        path = state_dir / f"{stack}.json"
        try:
            data = json.loads(path.read_text())
        except FileNotFoundError:
            data = {}
        except ValueError:
            raise ConfigError(f"teardown journal {path} is not valid JSON; inspect it, then delete it and re-run") from None
        if data.get("completed"):
            data = {}      # a finished teardown: this is a new campaign's teardown
        data.setdefault("stack", stack)
        data.setdefault("steps", {})
        return cls(path, data)

    def done(self, step: str) -> bool:
        return step in self.data["steps"]

    def mark(self, step: str, **extra: Any) -> None:
        self.data["steps"][step] = {"utc": _now().isoformat(), **extra}
        self.save()

    def unmark(self, step: str) -> None:
        self.data["steps"].pop(step, None)
        self.save()

    def save(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text(json.dumps(self.data, indent=1, sort_keys=True, default=str))
        os.replace(tmp, self.path)


def _now() -> datetime:
    return datetime.now(timezone.utc)


def _parse_utc(text: str) -> datetime | None:
    try:
        t = datetime.fromisoformat(text.replace("Z", "+00:00"))
    except (TypeError, ValueError):
        return None
    return t if t.tzinfo else t.replace(tzinfo=timezone.utc)


# ---------------------------------------------------------------------------------------------
# Evidence from each tier


def lustre_checkpoints(mount: Path, prefix: str, *, hash_unhashed: bool = False
                       ) -> tuple[tuple[CheckpointRecord, ...], tuple[str, ...]]:
    """Committed checkpoints under <mount><prefix>/<model>/ (markers scanned), and uncommitted dirs.

    Each record carries the marker's own xxh3 (the Blob marker must be the same bytes) and the
    manifest's file hashes; `hash_unhashed` hashes the Lustre copy of files saved without a hash
    (for --verify-content, which needs something to compare the download with).
    """
    root = mount / prefix.strip("/")
    if not root.is_dir():
        raise ConfigError(
            f"--lustre-root {mount}: {root} does not exist; pass the mount point of the file system (e.g. /lustrefs) "
            "on a node where it is mounted, or leave --lustre-root out to use the markers in Blob"
        )
    records: list[CheckpointRecord] = []
    uncommitted: list[str] = []
    # Dot-directories (bench scratch, locks) are never a model's checkpoints.
    models = sorted(e.name for e in os.scandir(root) if e.is_dir(follow_symlinks=False) and not e.name.startswith("."))
    for model in models:
        for info in mf.scan(root, model):
            if info.manifest is None:
                uncommitted.append(f"{model}/{info.name}")
                continue
            marker = info.path / mf.MARKER
            try:
                st = os.lstat(marker)
                data = fsafe.read_file(marker, anchor=root, limit=MARKER_LIMIT)
            except OSError as e:      # deleted or replaced since the scan: not committed now
                uncommitted.append(f"{model}/{info.name} (marker unreadable: {e.strerror or e})")
                continue
            hashes = []
            for f in info.manifest.files:
                h = f.hash
                if h is None and hash_unhashed:
                    h = _hash_lustre(info.path / f.path, root)
                hashes.append((f.path, h))
            records.append(CheckpointRecord(
                model=model, name=info.name, committed_utc=datetime.fromtimestamp(st.st_mtime, timezone.utc),
                files=tuple((f.path, f.size) for f in info.manifest.files), marker_size=len(data),
                hashes=tuple(hashes), marker_hash=hash_bytes(data)))
    return tuple(records), tuple(uncommitted)


MARKER_LIMIT = 64 << 20     # a marker is a small JSON document; anything larger is not one


def hash_bytes(data: bytes) -> str:
    h = new_hasher()
    h.update(data)
    return h.hexdigest()


def _hash_lustre(path: Path, anchor: Path) -> str | None:
    try:
        fd = fsafe.open_file(path, anchor=anchor)
    except OSError:
        return None
    with os.fdopen(fd, "rb", buffering=0) as f:
        return hash_file(f)


@dataclass(frozen=True)
class BlobView:
    """One listing of the data container under the checkpoint prefix."""

    infos: dict[str, Any]        # relative path -> blobstore.BlobInfo
    etags: dict[str, str]        # relative path -> ETag (which version of the blob)

    @property
    def sizes(self) -> dict[str, int]:
        return {rel: b.size for rel, b in self.infos.items()}

    @property
    def meta_hashes(self) -> dict[str, str]:
        """The exporter's xxh3 metadata, where a blob has it (AMLFS auto-export writes none)."""
        return {rel: b.xxh3 for rel, b in self.infos.items() if b.xxh3}


def blob_listing(store: Any) -> BlobView:
    from tiered_ckpt.tiers.blob import BlobInfo

    start = (store.prefix + "/") if store.prefix else ""

    def go() -> BlobView:
        infos: dict[str, Any] = {}
        etags: dict[str, str] = {}
        for b in store.container.list_blobs(name_starts_with=start, include=["metadata"]):
            rel = store.rel(b.name)
            infos[rel] = BlobInfo(b.name, int(b.size or 0), dict(b.metadata or {}))
            etags[rel] = _etag(b.etag)
        return BlobView(infos, etags)

    return store.retry(f"listing {start or 'the container'}", go)  # type: ignore[no-any-return]


def blob_evidence(store: Any, with_markers: bool, view: BlobView | None = None
                  ) -> tuple[dict[str, int], tuple[CheckpointRecord, ...], tuple[tuple[str, str], ...]]:
    """(relative path -> size under the prefix, checkpoints whose markers parse, bad markers)."""
    view = view if view is not None else blob_listing(store)
    listing = view.sizes
    records: list[CheckpointRecord] = []
    bad: list[tuple[str, str]] = []
    if not with_markers:
        return listing, (), ()
    from tiered_ckpt.tiers.blob import archived_markers

    for marker in archived_markers(store, view.infos):
        m = marker.manifest
        if m is None:
            bad.append((marker.rel, marker.problem))
            continue
        records.append(CheckpointRecord(model=marker.model, name=m.name, committed_utc=_parse_utc(m.created_utc),
                                        files=tuple((f.path, f.size) for f in m.files), marker_size=marker.size,
                                        hashes=tuple((f.path, f.hash) for f in m.files)))
    return listing, tuple(records), tuple(bad)


def _etag(value: Any) -> str:
    """An ETag as one spelling: the listing and a download quote it differently."""
    return str(value or "").strip('"')


def download_hash(store: Any, rel: str, progress: Callable[[int], None] | None = None,
                  concurrency: int = 2) -> tuple[str, str] | None:
    """(ETag, xxh3-128) of a blob's content, streamed (never held whole); None if it is gone."""
    from azure.core.exceptions import ResourceNotFoundError

    name = store.name(rel)

    def go() -> tuple[str, str]:
        h = new_hasher()
        dl = store.container.download_blob(name, max_concurrency=concurrency)
        for chunk in dl.chunks():
            h.update(chunk)
            if progress is not None:
                progress(len(chunk))
        return _etag(dl.properties.etag), h.hexdigest()

    try:
        return store.retry(f"downloading {name}", go)  # type: ignore[no-any-return]
    except ResourceNotFoundError:
        return None


def make_blob_store(outputs: StackOutputs, connection_string: str | None) -> Any:
    from tiered_ckpt.config import ArchiveConfig
    from tiered_ckpt.tiers.blob import BlobStore

    outputs.require("dataContainer")
    if not connection_string:
        outputs.require("storageAccountUrl")
    cfg = ArchiveConfig(
        account_url=None if connection_string else str(outputs.get("storageAccountUrl")),
        connection_string=connection_string,
        container=str(outputs.get("dataContainer")),
        prefix=outputs.prefix.strip("/"),
        retries=2,
    )
    return BlobStore(cfg, backoff=0.2)


# ---------------------------------------------------------------------------------------------
# The teardown


class Teardown:
    def __init__(self, opts: Options, *, pulumi: PulumiCli | None = None, sleep: Callable[[float], None] = time.sleep,
                 ask: Callable[[str], str] | None = None) -> None:
        self.o = opts
        self.pulumi = pulumi or PulumiCli(opts.stack, opts.project_dir)
        self.sleep = sleep
        self.ask = ask or _ask
        self.journal = Journal.load(opts.state_dir, opts.stack)
        self._jobs: AmlfsJobs | None = None
        self._store: Any = None
        self.outputs = StackOutputs({})
        self.manual: ManualArchive | None = None
        self._hash_cache: dict[str, tuple[str, str]] = {}     # blob rel -> (ETag, xxh3 of its content)

    # -- output -----------------------------------------------------------------------------
    def say(self, msg: str) -> None:
        sys.stderr.write(redact(msg) + "\n")
        sys.stderr.flush()

    def confirm(self, question: str) -> bool:
        if self.o.yes:
            return True
        return self.ask(f"{question} [y/N] ").strip().lower() in ("y", "yes")

    # -- clients ------------------------------------------------------------------------------
    def jobs(self) -> AmlfsJobs:
        if self._jobs is None:
            self._jobs = AmlfsJobs(self.outputs.target(self.o.arm_endpoint))
        return self._jobs

    def store(self) -> Any:
        if self._store is None:
            self._store = make_blob_store(self.outputs, self.o.connection_string)
        return self._store

    # -- evidence -----------------------------------------------------------------------------
    def export_state(self) -> ExportState:
        try:
            st = self.jobs().autoexport_status()
        except ArmNotFoundError:
            return ExportState("NotFound")
        return ExportState(st.state, st.admin_status, st.last_success_utc, st.total_files_failed,
                           st.current_iteration_files_failed, st.status_message, st.export_iteration_count)

    def collect(self, manual: ManualArchive | None = None) -> Evidence:
        present = self.outputs.compute_present
        export = self.export_state() if present else None
        ours = self.journal.done("autoexport_disabled")
        if export is not None and export.state == "NotFound" and ours:
            # An earlier run of this teardown disabled auto-export and its `pulumi up` got as far as
            # deleting the file system: nothing is left on Lustre to protect.
            present = False
        lustre = uncommitted = None
        if present and self.o.lustre_root is not None:
            lustre, uncommitted = lustre_checkpoints(self.o.lustre_root, self.outputs.prefix,
                                                     hash_unhashed=self.o.verify_content)
        blob = None
        blob_ckpts: tuple[CheckpointRecord, ...] = ()
        bad: tuple[tuple[str, str], ...] = ()
        meta: dict[str, str] = {}
        markers: dict[str, str | None] = {}
        content: dict[str, str] | None = None
        if self.o.blob_check:
            try:
                view = blob_listing(self.store())
                blob, blob_ckpts, bad = blob_evidence(self.store(), with_markers=lustre is None, view=view)
                meta = view.meta_hashes
                expected = lustre if lustre is not None else blob_ckpts
                if lustre is not None:
                    markers = self.marker_hashes(lustre, view)
                if self.o.verify_content and present:
                    content = self.content_hashes(expected, view)
            except UserError as e:
                raise UserError(
                    f"{e}. The gate lists the data container to prove the archive: run where the storage account's "
                    "firewall admits you (a node in the VNet, or add your IP) with Storage Blob Data Reader, or pass "
                    "--no-blob-check to rely on the auto-export counters alone", exit_code=e.exit_code) from None
        hsm: dict[str, str] | None = None
        hsm_note = ""
        if lustre is not None:
            hsm, hsm_note = self.hsm_states(lustre)
        baseline = self.journal.data.get("iteration_baseline")
        # A dry run does not wait, so it takes no baseline; the gate then says a real run will wait.
        if baseline is None and export is not None and export.iteration_count is not None and not self.o.dry_run:
            baseline = export.iteration_count
            self.journal.data["iteration_baseline"] = baseline
            self.journal.save()
        return Evidence(compute_present=present, export=export, disabled_by_teardown=ours, manual_archive=manual,
                        lustre=lustre, lustre_uncommitted=uncommitted or (), blob=blob, blob_checkpoints=blob_ckpts,
                        blob_bad_markers=bad, iteration_baseline=baseline, blob_hashes=meta,
                        blob_marker_hashes=markers, hsm=hsm, hsm_note=hsm_note, content=content)

    # -- content evidence ---------------------------------------------------------------------
    def marker_hashes(self, records: tuple[CheckpointRecord, ...], view: BlobView) -> dict[str, str | None]:
        """xxh3 of each Lustre checkpoint's marker as Blob holds it (downloaded: markers are small)."""
        out: dict[str, str | None] = {}
        for rec in records:
            rel = f"{rec.model}/{rec.name}/{mf.MARKER}"
            if rel not in view.infos:
                continue
            got = self._cached(rel, view, lambda r: download_hash(self.store(), r, concurrency=1))
            out[rel] = got
        return out

    def content_hashes(self, records: tuple[CheckpointRecord, ...], view: BlobView) -> dict[str, str]:
        """--verify-content: download and hash every file the checkpoints name (streamed, in parallel).

        A blob is hashed once per version (ETag) across the gate's polls and its final re-check.
        """
        want = [f"{r.model}/{r.name}/{p}" for r in records for p, size in r.files if view.infos.get(f"{r.model}/{r.name}/{p}")
                and view.infos[f"{r.model}/{r.name}/{p}"].size == size]
        todo = [rel for rel in want if self._hash_cache.get(rel, ("", ""))[0] != view.etags.get(rel) or not view.etags.get(rel)]
        if todo:
            nbytes = sum(view.infos[rel].size for rel in todo)
            self.say(f"verify-content: downloading and hashing {len(todo)} file(s), {human_bytes(nbytes)} "
                     f"({len(want) - len(todo)} already hashed), {self.o.download_concurrency} at a time ...")
            t0 = time.monotonic()
            lock = threading.Lock()
            done = [0, 0]
            last = [t0]

            def one(rel: str, advance: Callable[[int], None]) -> None:
                def progress(n: int) -> None:
                    advance(n)
                    with lock:
                        done[0] += n
                        now = time.monotonic()
                        if now - last[0] >= 30:      # a line every 30 s where no progress bar shows
                            last[0] = now
                            self.say(f"verify-content: {human_bytes(done[0])} of {human_bytes(nbytes)} hashed")

                got = download_hash(self.store(), rel, progress)
                with lock:
                    done[1] += 1
                    if got is not None:
                        self._hash_cache[rel] = got

            with byte_progress("verify content", nbytes) as bar, \
                    ThreadPoolExecutor(max(1, min(self.o.download_concurrency, len(todo)))) as ex:
                for f in [ex.submit(one, rel, bar.advance) for rel in todo]:
                    f.result()
            dt = max(time.monotonic() - t0, 1e-9)
            self.say(f"verify-content: {done[1]} file(s), {human_bytes(done[0])} hashed in {dt:.1f} s "
                     f"({human_bytes(done[0] / dt)}/s)")
        return {rel: self._hash_cache[rel][1] for rel in want
                if rel in self._hash_cache and self._hash_cache[rel][0] == view.etags.get(rel)}

    def _cached(self, rel: str, view: BlobView, fetch: Callable[[str], tuple[str, str] | None]) -> str | None:
        etag = view.etags.get(rel)
        hit = self._hash_cache.get(rel)
        if hit is None or not etag or hit[0] != etag:
            got = fetch(rel)
            if got is None:
                return None
            self._hash_cache[rel] = got
            hit = got
        # A blob rewritten between the listing and the download: its hash is not the listed version's.
        return hit[1] if hit[0] == etag else None

    def hsm_states(self, records: tuple[CheckpointRecord, ...]) -> tuple[dict[str, str] | None, str]:
        """`lfs hsm_state` of every file the Lustre checkpoints name: "" when archived and clean."""
        from tiered_ckpt.errors import UnavailableError
        from tiered_ckpt.tiers.hsm import Lfs

        assert self.o.lustre_root is not None
        base = self.o.lustre_root / self.outputs.prefix.strip("/")
        paths = {str(base / r.model / r.name / p): f"{r.model}/{r.name}/{p}" for r in records for p, _ in r.files}
        if not paths:
            return {}, ""
        try:
            states, errors = Lfs(self.o.lfs).states(list(paths))
        except UnavailableError as e:
            return None, str(e)
        out: dict[str, str] = {}
        for path, rel in paths.items():
            st = states.get(path)
            if st is None:
                out[rel] = f"lfs hsm_state failed: {errors.get(path, 'no answer')}"
            else:
                out[rel] = "" if st.archived else st.why_not_archived()
        return out, ""

    # -- the gate with waiting and the optional manual export ---------------------------------
    def gate(self) -> GateResult:
        deadline = time.monotonic() + self.o.wait_timeout
        manual: ManualArchive | None = None
        last: tuple[float, int] | None = None
        while True:
            result = evaluate(self.collect(manual))
            if result.ok or self.o.dry_run or self.o.force:
                return result
            if self.o.manual_export and manual is None and self.outputs.compute_present:
                manual = self.manual = self.manual_export(deadline)
                continue
            left = deadline - time.monotonic()
            if left <= 0:
                return result
            have = result.total_bytes - result.missing_bytes
            rate = eta = ""
            if last is not None and result.total_bytes:
                dt = time.monotonic() - last[0]
                r = (have - last[1]) / dt if dt > 0 else 0.0
                if r > 0:
                    rate = f", {human_bytes(r)}/s"
                    eta = f", ETA {result.missing_bytes / r:.0f} s"
            last = (time.monotonic(), have)
            size = f"{human_bytes(have)} of {human_bytes(result.total_bytes)} in Blob{rate}{eta}; " if result.total_bytes else ""
            self.say(f"waiting for the archive: {size}{len(result.problems)} problem(s), first: {result.problems[0].message}; "
                     f"{left / 60:.1f} min left (--wait-timeout)")
            self.sleep(min(self.o.poll_interval, max(left, 0.0)))

    def manual_export(self, deadline: float) -> ManualArchive:
        """Disable auto-export, archive the checkpoint prefix, wait. One blob job at a time."""
        jobs, prefix = self.jobs(), self.outputs.prefix
        while True:
            busy = jobs.running_blob_jobs()
            if not busy:
                break
            if time.monotonic() >= deadline:
                raise Refused(f"cannot start the manual export: another blob job is still running ({', '.join(busy)}) "
                              "after --wait-timeout; nothing was changed. Re-run when it has finished")
            self.say(f"manual export: waiting for {', '.join(busy)} to finish (one blob job at a time)")
            self.sleep(self.o.poll_interval)
        self.say("manual export: disabling auto-export (one blob job at a time) ...")
        self.journal.mark("autoexport_disabled", by="manual-export")
        jobs.disable_autoexport(timeout=max(deadline - time.monotonic(), 1.0))
        started = _now()
        self.say(f"manual export: archiving {prefix} ...")
        jobs.start_archive(prefix)
        self.journal.mark("manual_archive_started", path=prefix, started=started.isoformat())

        def progress(p: ArchiveProgress) -> None:
            self.say(f"manual export of {prefix}: {p.state} {p.percent if p.percent is not None else '?'}%")

        try:
            prog = jobs.wait_archive(prefix, timeout=max(deadline - time.monotonic(), 1.0), on_progress=progress)
            state = prog.state
        except UserError as e:
            self.say(f"manual export: {e}")
            state = jobs.archive_status(prefix).state
        return ManualArchive(started, state)

    def reenable_autoexport(self) -> str:
        """Undo our disable (refusal or decline). Returns a sentence for the report."""
        if not self.journal.done("autoexport_disabled") or not self.outputs.compute_present:
            return ""
        try:
            st = self.jobs().autoexport_status()
            if st.admin_status == "Enable" and st.state == "InProgress":
                # Our disable was refused outright (e.g. 403): there is nothing to undo.
                self.journal.unmark("autoexport_disabled")
                return ""
            self.jobs().enable_autoexport()
        except UserError as e:
            return f"auto-export is still DISABLED (re-enabling failed: {e}); run: {self.jobs().target.enable_command()}"
        self.journal.unmark("autoexport_disabled")
        return "auto-export was re-enabled"

    # -- plan ---------------------------------------------------------------------------------
    def plan(self) -> list[dict[str, str]]:
        p, o = self.pulumi, self.outputs
        steps = [{"step": "outputs", "what": "read the stack outputs", "command": p.text("stack", "output", "--json")}]
        if o.compute_present:
            t = o.target(self.o.arm_endpoint)
            steps.append({"step": "gate", "what": (
                f"prove the archive holds every committed checkpoint: auto-export {t.autoexport_job} on {t.filesystem} "
                f"(InProgress, last iteration after the newest commit, zero failed files)"
                + (f", Blob container {o.get('dataContainer')} under {o.prefix} (markers, file sizes and content: "
                   + ("every file downloaded and hashed" if self.o.verify_content else
                      "exporter hash metadata or lfs hsm_state") + ")" if self.o.blob_check else "")
                + (f", Lustre markers under {self.o.lustre_root}{o.prefix}" if self.o.lustre_root else "")
                + f"; wait up to {self.o.wait_timeout / 60:.0f} min"
                + ("; if needed, disable auto-export and run a manual archive of " + o.prefix if self.o.manual_export else "")),
                "command": ""})
            steps.append({"step": "disable-autoexport", "what": f"disable auto-export {t.autoexport_job} and wait for Disabled",
                          "command": t.enable_command().replace('"Enable"', '"Disable"')})
        steps.append({"step": "config", "what": "turn the compute side off (the archive stays managed)",
                      "command": p.text("config", "set", COMPUTE_KEY, "false")})
        if not self.o.yes:
            steps.append({"step": "preview", "what": "show what `pulumi up` will delete, then ask",
                          "command": p.text("preview", "--diff")})
        steps.append({"step": "up", "what": "delete the GPU cluster, the file system (and its auto-export job) and the network",
                      "command": p.text("up", "--yes")})
        return steps

    def come_back(self) -> list[str]:
        s = self.o.stack
        return [f"pulumi config set {COMPUTE_KEY} true --stack {s} && pulumi up --stack {s}",
                "tiered-ckpt restore --latest   # on a node of the new cluster"]

    # -- run ------------------------------------------------------------------------------------
    def run(self) -> dict[str, Any]:
        self.say(f"reading the outputs of stack {self.o.stack} ...")
        before = StackOutputs(self.pulumi.outputs())
        self.outputs = before
        before.require("storageAccountName", "dataContainer")
        resumed = sorted(self.journal.data["steps"])
        if resumed:
            self.say(f"continuing an interrupted teardown (done: {', '.join(resumed)}; journal {self.journal.path})")
        plan = self.plan()
        result: dict[str, Any] = {"ok": False, "stack": self.o.stack, "dry_run": self.o.dry_run, "plan": plan,
                                  "resumed_steps": resumed}
        if not before.compute_present:
            self.say(f"stack {self.o.stack} has no file system (computeEnabled false): the compute side is already gone")

        try:
            gate = self.gate()
        except UserError as e:
            undo = "" if self.o.dry_run else self.reenable_autoexport()
            raise UserError(f"{e}{'; ' + undo if undo else ''}", exit_code=e.exit_code) from None
        result["gate"] = gate.to_json()
        # A refusal lists the problems in its error message; print them here only when not refusing.
        self._print_gate(gate, problems=gate.ok or self.o.dry_run or self.o.force)
        if not gate.ok and not self.o.force:
            undo = "" if self.o.dry_run else self.reenable_autoexport()
            result.update(refused=True, undo=undo)
            if self.o.dry_run:
                self.say("dry run: the teardown would refuse here; nothing was changed")
                return result
            raise Refused(self._refusal(gate, undo), result=result)
        if self.o.dry_run:
            self.say("dry run: these steps would run; nothing was changed:")
            for s in plan:
                self.say(f"  {s['step']}: {s['what']}" + (f"\n      {s['command']}" if s["command"] else ""))
            result["ok"] = True
            return result
        if self.o.force and not gate.ok:
            typed = self.ask(f"--force: the gate found {len(gate.problems)} problem(s) above; checkpoints not in Blob will be "
                             f"LOST. Type the stack name ({self.o.stack}) to continue: ").strip()
            if typed != self.o.stack:
                raise Refused(f"--force: you typed {typed!r}, not the stack name {self.o.stack!r}; nothing was changed",
                              result=result)
            result["forced"] = True
        if not self.confirm(f"remove the compute side of stack {self.o.stack} (the archive stays)?"):
            raise Refused("not confirmed; nothing was changed", result=result)

        if before.compute_present:
            self.disable_autoexport()
            if not self.o.force:
                # Auto-export is off now, so the proof cannot go stale; check once more that
                # nothing was committed between the gate and the disable.
                final = evaluate(self.collect(self.manual))
                if not final.ok:
                    self._print_gate(final, problems=False)
                    undo = self.reenable_autoexport()
                    result.update(refused=True, gate=final.to_json(), undo=undo)
                    raise Refused(self._refusal(final, undo), result=result)

        if not self.journal.done("config_previous"):
            self.journal.mark("config_previous", value=self.pulumi.config_get(COMPUTE_KEY))
        self.say(f"$ {self.pulumi.text('config', 'set', COMPUTE_KEY, 'false')}")
        self.pulumi.config_set(COMPUTE_KEY, "false")
        self.journal.mark("config_set")
        if not self.o.yes:
            self.say(f"$ {self.pulumi.text('preview', '--diff')}")
            self.pulumi.stream("preview", "--diff")
            if not self.confirm("apply this update (delete what the preview lists)?"):
                undo = self.undo_config()
                undo2 = self.reenable_autoexport()
                raise Refused(f"not confirmed; nothing was removed ({'; '.join(x for x in (undo, undo2) if x)})", result=result)
        self.say(f"$ {self.pulumi.text('up', '--yes')}")
        try:
            self.pulumi.stream("up", "--yes")
        except UserError as e:
            back = f"pulumi config set {COMPUTE_KEY} true --stack {self.o.stack} && pulumi up --stack {self.o.stack}"
            if before.compute_present:
                # `pulumi up` does not see the out-of-band PATCH (no refresh), so say how to undo it.
                back += f", then re-enable auto-export: {self.jobs().target.enable_command()}"
            raise UserError(
                f"{e}. The teardown stopped after disabling auto-export and setting {COMPUTE_KEY}=false. Re-run the same "
                f"command to continue (journal {self.journal.path}); to go back to training instead: {back}",
                exit_code=e.exit_code) from None
        self.journal.mark("up_done")
        after = StackOutputs(self.pulumi.outputs())
        report = self.report(before, after, gate)
        result.update(ok=True, **report)
        self.journal.data["completed"] = _now().isoformat()
        self.journal.save()
        return result

    def disable_autoexport(self) -> None:
        jobs = self.jobs()
        st = self.export_state()
        if st.state == "NotFound":
            # Gone already (an earlier run's `pulumi up`), or --force over a missing job: nothing to stop.
            self.say(f"auto-export job {jobs.target.autoexport_job} on {jobs.target.filesystem} not found; nothing to disable")
            return
        if st.state == "Disabled":
            self.say(f"auto-export {jobs.target.autoexport_job} is already Disabled")
            self.journal.mark("autoexport_disabled", by=self.journal.data["steps"].get("autoexport_disabled", {}).get("by", "teardown"))
            return
        self.say(f"disabling auto-export {jobs.target.autoexport_job} and waiting for Disabled ...")
        try:
            self.journal.mark("autoexport_disabled", by="teardown")
            jobs.disable_autoexport(timeout=self.o.disable_timeout)
        except UserError as e:
            undo = self.reenable_autoexport()
            raise UserError(f"{e}. Nothing was removed (no pulumi config set/up ran){'; ' + undo if undo else ''}",
                          exit_code=e.exit_code) from None

    def undo_config(self) -> str:
        prev = (self.journal.data["steps"].get("config_previous") or {}).get("value")
        if prev is None:
            self.pulumi.config_rm(COMPUTE_KEY)
        else:
            self.pulumi.config_set(COMPUTE_KEY, str(prev))
        self.journal.unmark("config_set")
        return f"{COMPUTE_KEY} restored to {prev if prev is not None else 'its default (unset)'}"

    # -- messages -------------------------------------------------------------------------------
    def _print_gate(self, gate: GateResult, problems: bool = True) -> None:
        self.say(f"gate: {'PASS' if gate.ok else 'FAIL'}")
        for e in gate.evidence:
            self.say(f"  evidence: {e}")
        for w in gate.warnings:
            self.say(f"  warning: {w}")
        if problems:
            for p in gate.problems:
                self.say(f"  missing: {p.message}")

    def _refusal(self, gate: GateResult, undo: str) -> str:
        lines = [f"refusing to tear down stack {self.o.stack}: the archive does not provably hold every committed checkpoint; "
                 f"nothing was removed{' (' + undo + ')' if undo else ''}. What is missing:"]
        lines += [f"  - {p.message}" for p in gate.problems]
        lines.append("Wait longer (--wait-timeout 2h), run a manual export (--manual-export), or, knowing what is lost, "
                     "--force (you will be asked to type the stack name)")
        return "\n".join(lines)

    def report(self, before: StackOutputs, after: StackOutputs, gate: GateResult) -> dict[str, Any]:
        removed = {k: before.get(k) for k in ("amlfsName", "autoExportJobName", "computeResourceGroup", "nodeCount", "scaleSetName")
                   if before.get(k) is not None}
        archive = {"storageAccountName": after.get("storageAccountName") or before.get("storageAccountName"),
                   "storageAccountUrl": after.get("storageAccountUrl") or before.get("storageAccountUrl"),
                   "dataContainer": after.get("dataContainer") or before.get("dataContainer"),
                   "checkpointPrefix": before.prefix, "newestCheckpoint": gate.newest,
                   "checkpoints": len(gate.checkpoints)}
        out = {"removed": removed, "archive": archive, "come_back": self.come_back()}
        if not self.o.as_json:
            print(f"Teardown of stack {self.o.stack} done.")
            if removed:
                print(f"Removed: file system {removed.get('amlfsName')} with auto-export job {removed.get('autoExportJobName')}, "
                      f"the GPU cluster ({removed.get('nodeCount', '?')} nodes), the network, and resource group "
                      f"{removed.get('computeResourceGroup')}.")
            else:
                print("Removed: nothing this time (the compute side was already gone); the stack is converged.")
            print(f"Checkpoints are in storage account {archive['storageAccountName']}, container {archive['dataContainer']}, "
                  f"prefix {archive['checkpointPrefix']}/ ({archive['checkpoints']} committed; newest {gate.newest or 'none'}).")
            print("To come back:")
            for c in self.come_back():
                print(f"  {c}")
        return out


# ---------------------------------------------------------------------------------------------
# Deleting the archive: separate, explicit, typed confirmation


def delete_archive(opts: Options, *, pulumi: PulumiCli | None = None, ask: Callable[[str], str] | None = None) -> dict[str, Any]:
    cli = pulumi or PulumiCli(opts.stack, opts.project_dir)
    asker = ask or _ask
    o = StackOutputs(cli.outputs())
    if o.compute_present:
        raise Refused(
            f"stack {opts.stack} still has its compute side (file system {o.get('amlfsName')}); tear it down first "
            f"(make teardown STACK={opts.stack}), then delete the archive; nothing was changed")
    o.require("storageAccountName")
    account = str(o.get("storageAccountName"))
    inventory: dict[str, Any] = {"storageAccountName": account, "storageResourceGroup": o.get("storageResourceGroup"),
                                 "dataContainer": o.get("dataContainer"), "loggingContainer": o.get("loggingContainer")}
    if opts.blob_check:
        listing, ckpts, _ = blob_evidence(make_blob_store(o, opts.connection_string), with_markers=True)
        inventory.update(blobs=len(listing), bytes=sum(listing.values()), checkpoints=sorted(r.key for r in ckpts))
    commands = [cli.text("state", "unprotect", "--all", "--yes"), cli.text("destroy", "--yes")]
    result: dict[str, Any] = {"ok": False, "stack": opts.stack, "dry_run": opts.dry_run, "deletes": inventory, "plan": commands}
    sys.stderr.write(
        f"delete-archive: this PERMANENTLY deletes storage account {account} (resource group {o.get('storageResourceGroup')}), "
        f"its containers {o.get('dataContainer')} and {o.get('loggingContainer')}"
        + (f" with {inventory['blobs']} blob(s), {human_bytes(inventory['bytes'])}, {len(inventory['checkpoints'])} committed "
           f"checkpoint(s)" if "blobs" in inventory else "")
        + ", its lifecycle policy and the file-system role grants. Blob soft delete does not cover a deleted account.\n"
        + "".join(f"  $ {c}\n" for c in commands))
    if opts.dry_run:
        sys.stderr.write("dry run: nothing was changed\n")
        result["ok"] = True
        return result
    typed = asker(f"type the storage account name ({account}) to delete it: ").strip()
    if typed != account:
        raise Refused(f"you typed {typed!r}, not the storage account name {account!r}; nothing was deleted")
    cli.stream("state", "unprotect", "--all", "--yes")
    cli.stream("destroy", "--yes")
    result["ok"] = True
    if not opts.as_json:
        print(f"Archive of stack {opts.stack} deleted (storage account {account}). The stack itself remains: "
              f"pulumi stack rm {opts.stack} removes it.")
    return result


def _ask(prompt: str) -> str:
    sys.stderr.write(prompt)
    sys.stderr.flush()
    line = sys.stdin.readline()
    return line.rstrip("\n")
