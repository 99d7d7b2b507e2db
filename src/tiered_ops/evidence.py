"""Evidence for the teardown gate, gathered from each tier: stack outputs, ARM, Blob, Lustre.

The gate (tiered_ops.gate.evaluate) is pure; this module reads what it decides over:
`StackOutputs` (what `pulumi stack output` says the stack holds), the auto-export job's status
through ARM, one listing of the data container (sizes, ETags, exporter hash metadata, the
markers archived there), optionally the committed markers on a Lustre mount and `lfs hsm_state`
of their files, and, with --verify-content, the hash of every blob's downloaded content.
`Collector.collect` puts one `Evidence` together for each look of the gate.
"""
from __future__ import annotations

import errno
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from tiered_ckpt.cli.output import byte_progress, human_bytes
from tiered_ckpt.errors import ConfigError, UnavailableError, UserError
from tiered_ckpt.io import commit, fsafe
from tiered_ckpt.io.hashing import hash_file, new_hasher
from tiered_ckpt.io.marker import MARKER
from tiered_ckpt.tiers.arm import AmlfsJobs, AmlfsTarget, ArmNotFoundError
from tiered_ops.gate import EXPORT_NOT_FOUND, CheckpointRecord, Evidence, ExportState, ManualArchive
from tiered_ops.teardown_state import Journal, Options

# ---------------------------------------------------------------------------------------------
# Stack outputs


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


def _parse_utc(text: str) -> datetime | None:
    try:
        t = datetime.fromisoformat(text.replace("Z", "+00:00"))
    except (TypeError, ValueError):
        return None
    return t if t.tzinfo else t.replace(tzinfo=timezone.utc)


# ---------------------------------------------------------------------------------------------
# Lustre: committed markers on the mount


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
        # Every model, whatever its `naming:` (not known here): a directory canonical in any
        # built-in scheme is checked, so none is torn down unarchived for being named differently.
        for info in commit.scan(root, model, None):
            if info.manifest is None:
                uncommitted.append(f"{model}/{info.name}")
                continue
            marker = info.path / MARKER
            try:
                st = os.lstat(marker)
                data = commit.marker_bytes(info.path, anchor=root)
                if data is None:
                    raise FileNotFoundError(errno.ENOENT, "no marker", str(marker))
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



# ---------------------------------------------------------------------------------------------
# Blob: one listing, the archived markers, downloaded content

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

    for marker in archived_markers(store, view.infos, None):
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
# One Evidence per look of the gate


class Collector:
    """Gathers an Evidence for the gate; keeps the ARM and Blob clients and the content-hash cache across looks."""

    def __init__(self, opts: Options, journal: Journal, say: Callable[[str], None]) -> None:
        self.o = opts
        self.journal = journal
        self.say = say
        self.outputs = StackOutputs({})
        self._jobs: AmlfsJobs | None = None
        self._store: Any = None
        self._hash_cache: dict[str, tuple[str, str]] = {}     # blob rel -> (ETag, xxh3 of its content)

    # -- clients ------------------------------------------------------------------------------
    def jobs(self) -> AmlfsJobs:
        if self._jobs is None:
            self._jobs = AmlfsJobs(self.outputs.target(self.o.arm_endpoint))
        return self._jobs

    def store(self) -> Any:
        if self._store is None:
            self._store = make_blob_store(self.outputs, self.o.connection_string)
        return self._store

    # -- ARM, Blob, Lustre ----------------------------------------------------------------------
    def export_state(self) -> ExportState:
        try:
            st = self.jobs().autoexport_status()
        except ArmNotFoundError:
            return ExportState(EXPORT_NOT_FOUND)
        return ExportState(st.state, st.admin_status, st.last_success_utc, st.total_files_failed,
                           st.current_iteration_files_failed, st.status_message, st.export_iteration_count)

    def collect(self, manual: ManualArchive | None = None) -> Evidence:
        present = self.outputs.compute_present
        export = self.export_state() if present else None
        ours = self.journal.done("autoexport_disabled")
        if export is not None and export.state == EXPORT_NOT_FOUND and ours:
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
            rel = f"{rec.model}/{rec.name}/{MARKER}"
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
