"""Prometheus metrics of a model's checkpoints, from the tiers' state and the operation records.

Built with prometheus-client: `registry(cfg, backend)` is a CollectorRegistry whose collector looks
at the tiers on every collection (`status.gather`: markers, archive proof, backlog, export job,
capacity) and reads the last save/retention/restore records (tiered_ckpt.records). The CLI writes
it as a node-exporter textfile (`write_textfile`, atomic: a temporary file renamed into place) or serves it over HTTP (`tiered-ckpt metrics --serve`).

Every sample carries `model`. A part that could not be checked (the archive, the export job) is
reported by `tiered_ckpt_check_ok{part=...} 0` and its samples are left out, never shown as 0; a
record that is not one (hand-edited, another version's, a planted file) is left out and counted
in `tiered_ckpt_malformed_records{kind=...}`: one bad file never fails a scrape.

A collection lists markers and the archive, so it is not free: one collector serves every scrape
within CACHE_SECONDS from its last collection, and concurrent scrapes wait for the one collection
in progress instead of each starting its own (`tiered_ckpt_collections_total` counts them).
"""
from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator
from datetime import datetime, timezone
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from tiered_ckpt import records
from tiered_ckpt.config import NodeConfig
from tiered_ckpt.io import fsafe
from tiered_ckpt.lifecycle.status import Status, gather
from tiered_ckpt.naming import parse_name
from tiered_ckpt.tiers import memory as memory_tier
from tiered_ckpt.tiers.backends import TierBackend

PREFIX = "tiered_ckpt_"
ARCHIVED_TIERS = ("archived", "released", "only in archive")
RESTORE_PATHS = ("resident", "released", "import", "download")

# name -> help; one place for every metric the toolkit exports (the README's table follows it).
METRICS: dict[str, str] = {
    "save_seconds": "Wall time of the last save of the model, call to commit (s)",
    "save_bytes": "Bytes written by the last save",
    "save_throughput_bytes_per_second": "Bytes per second of the last save",
    "save_timestamp_seconds": "When the last save committed (Unix time)",
    "async_blocked_seconds": "Time the caller of the last async save was blocked (s)",
    "newest_committed_step": "Step of the newest committed checkpoint on either tier",
    "newest_archived_step": "Step of the newest checkpoint proven archived",
    "archive_lag_seconds": "Age of the oldest committed checkpoint not yet proven archived (0: none)",
    "export_backlog_files": "Files under the model not yet in the archive",
    "export_backlog_bytes": "Bytes under the model not yet in the archive",
    "export_failed_files": "Files the export job reports as failed",
    "retention_deleted_total": "Checkpoints deleted from the accelerator layer by retention",
    "retention_released_total": "Checkpoints released (HSM) by retention",
    "retention_blocked": "Checkpoints the last retention run could not free: not proven archived",
    "retention_timestamp_seconds": "When retention last ran (Unix time)",
    "restore_seconds": "Wall time of the last restore by path (s)",
    "restore_bytes": "Bytes made readable by the last restore by path",
    "accelerator_free_bytes": "Free bytes on the accelerator layer's file system",
    "check_ok": "1 if this part could be checked, 0 if not (its samples are then left out)",
    # The node-local memory tier (memory.dir; this node only): tiers/memory.summary.
    "memory_bytes": "Bytes this node's memory tier holds (own copies and replicas held for a peer)",
    "memory_budget_bytes": "memory.budget_bytes (0: bounded by the tmpfs only)",
    "memory_checkpoints": "Committed copies in this node's memory tier, by kind (own, peer)",
    "memory_newest_step": "Step of the newest committed own copy in this node's memory tier",
    "memory_saves_total": "Memory-tier saves by this node's ranks (since their processes started)",
    "memory_replica_lag_seconds": "Seconds from a memory commit to its replica committed on the peer (last save)",
    "memory_replica_failures_total": "Replica transfers that failed (the copy stays in this node's memory)",
    "memory_persists_total": "Memory checkpoints persisted to the checkpoint root",
    "memory_persist_failures_total": "Persists to the checkpoint root that failed",
    "memory_flushes_total": "Emergency flushes (SIGTERM, preemption notice) that persisted a checkpoint",
    "memory_restore_fallbacks_total": "Restores that fell from a memory source to the next after a failed check",
    "malformed_records": "Operation records that are not valid records (left out), by kind",
    "collections_total": "Collections of the tiers' state by this process (scrapes share one for a few seconds)",
}
# Seconds one collection serves scrapes for (Prometheus scrapes every 15-60 s by default; several
# scrapers or a dashboard's refresh then cost one listing of the tiers, not one each).
CACHE_SECONDS = 5.0


class _Collector(Collector):
    def __init__(self, cfg: NodeConfig, backend: TierBackend, cache_seconds: float = CACHE_SECONDS) -> None:
        self.cfg, self.backend, self.cache_seconds = cfg, backend, cache_seconds
        self.collections = 0
        self._lock = threading.Lock()            # one collection at a time; the others wait for it
        self._cached: tuple[float, list[Metric]] | None = None

    def collect(self) -> Iterator[Metric]:
        with self._lock:
            now = time.monotonic()
            if self._cached is None or now - self._cached[0] >= self.cache_seconds:
                self.collections += 1
                fams = self._collect()
                self._cached = (time.monotonic(), fams)
            fams = self._cached[1]
        total = GaugeMetricFamily(PREFIX + "collections_total", METRICS["collections_total"], labels=["model"])
        total.add_metric([self.cfg.model], float(self.collections))
        yield from fams
        yield total

    def _collect(self) -> list[Metric]:
        cfg = self.cfg
        out: dict[str, GaugeMetricFamily] = {}

        def put(name: str, value: float | None, **labels: str) -> None:
            if value is None:
                return
            fam = out.get(name)
            if fam is None:
                fam = out[name] = GaugeMetricFamily(PREFIX + name, METRICS[name], labels=["model", *labels])
            fam.add_metric([cfg.model, *labels.values()], float(value))

        st: Status | None = None
        try:
            st = gather(self.backend)
        except Exception as e:  # noqa: BLE001 - metrics must still say that the tiers were not readable
            put("check_ok", 0, part="tiers")
            put("check_ok", 0, part="archive")
            put("check_ok", 0, part="export")
            _ = e
        if st is not None:
            put("check_ok", 1, part="tiers")
            archive_ok = st.known("archive") and st.known("lfs")      # the proof needs both
            put("check_ok", 1 if archive_ok else 0, part="archive")
            export_ok = st.known("export")
            put("check_ok", 1 if export_ok else 0, part="export")
            committed = [c for c in st.checkpoints if c.tier in ("resident", "not yet archived", *ARCHIVED_TIERS)]
            steps = [(parse_name(c.name, cfg.naming), c) for c in committed]
            if steps:
                put("newest_committed_step", max(cid.step for cid, _ in steps if cid is not None))
            if archive_ok:
                archived = [cid.step for cid, c in steps if cid is not None and c.tier in ARCHIVED_TIERS]
                if archived:
                    put("newest_archived_step", max(archived))
                put("archive_lag_seconds", _lag(cfg, [c.name for c in committed if c.tier == "not yet archived"]))
            if st.backlog.files is not None:
                put("export_backlog_files", st.backlog.files)
                put("export_backlog_bytes", st.backlog.bytes)
            failed = st.export.get("total_files_failed", st.export.get("failed_files"))
            if export_ok and isinstance(failed, (int, float)):
                put("export_failed_files", failed)
            if st.capacity is not None:
                put("accelerator_free_bytes", st.capacity.free_bytes)
        self._records(put)
        self._memory(put)
        return list(out.values())

    def _memory(self, put: Any) -> None:
        cfg = self.cfg
        m = memory_tier.summary(cfg.memory, cfg.model, cfg.naming)
        if m is None:
            return
        put("memory_bytes", m.used_bytes)
        put("memory_budget_bytes", m.budget_bytes)
        put("memory_checkpoints", m.own, kind="own")
        put("memory_checkpoints", m.peer, kind="peer")
        put("memory_newest_step", m.newest_step)
        put("memory_saves_total", m.counters["saves"])
        put("memory_replica_lag_seconds", m.replica_lag_seconds)
        put("memory_replica_failures_total", m.counters["replica_failures"])
        put("memory_persists_total", m.counters["persists"])
        put("memory_persist_failures_total", m.counters["persist_failures"])
        put("memory_flushes_total", m.counters["flushes"])
        put("memory_restore_fallbacks_total", m.counters["fallbacks"])

    def _records(self, put: Any) -> None:
        """The records' samples; a malformed record (any value not the type its metric needs) is
        left out whole and counted."""
        cfg = self.cfg
        for kind in records.KINDS:
            rec, bad = records.read_checked(cfg.root, cfg.model, kind)
            got: list[tuple[str, float, dict[str, str]]] = []
            if rec is not None:
                try:
                    got = _record_samples(kind, rec)
                except (TypeError, ValueError, AttributeError, ZeroDivisionError, OverflowError):
                    bad = True
            put("malformed_records", 1 if bad else 0, kind=kind)
            if not bad:
                for name, v, labels in got:
                    put(name, v, **labels)


def _num(v: Any) -> float | None:
    """A record's number (None: absent); anything else raises TypeError (the record is malformed)."""
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise TypeError(f"not a number: {v!r}")
    return float(v)


def _record_samples(kind: str, rec: dict[str, Any]) -> list[tuple[str, float, dict[str, str]]]:
    out: list[tuple[str, float, dict[str, str]]] = []

    def add(name: str, v: Any, **labels: str) -> None:
        n = _num(v)
        if n is not None:
            out.append((name, n, labels))

    if kind == records.SAVE:
        add("save_seconds", rec.get("seconds"))
        add("save_bytes", rec.get("bytes"))
        secs = _num(rec.get("seconds"))
        if secs:
            add("save_throughput_bytes_per_second", (_num(rec.get("bytes")) or 0.0) / secs)
        add("save_timestamp_seconds", rec.get("time_unix"))
    elif kind == records.ASYNC_SAVE:
        add("async_blocked_seconds", rec.get("blocked_seconds"))
    elif kind == records.RETENTION:
        totals = rec.get("totals") or {}
        add("retention_deleted_total", totals.get("deleted", 0))
        add("retention_released_total", totals.get("released", 0))
        add("retention_blocked", rec.get("blocked"))
        add("retention_timestamp_seconds", rec.get("time_unix"))
    elif kind == records.RESTORE:
        by_path = rec.get("by_path") or {}
        for path, last in by_path.items():
            if path in RESTORE_PATHS and isinstance(last, dict):
                add("restore_seconds", last.get("seconds"), path=path)
                add("restore_bytes", last.get("bytes"), path=path)
    return out


def _lag(cfg: NodeConfig, pending: list[str]) -> float:
    """Seconds since the oldest not-yet-archived checkpoint committed (its marker's mtime)."""
    oldest: float | None = None
    for name in pending:
        try:
            t = os.stat(os.path.join(cfg.root, cfg.model, name, "COMMITTED.json")).st_mtime
        except OSError:
            continue
        oldest = t if oldest is None else min(oldest, t)
    return 0.0 if oldest is None else max(0.0, datetime.now(timezone.utc).timestamp() - oldest)


def registry(cfg: NodeConfig, backend: TierBackend) -> CollectorRegistry:
    """A registry that collects the model's metrics (once per CACHE_SECONDS, module doc)."""
    reg = CollectorRegistry(auto_describe=False)
    reg.register(_Collector(cfg, backend))
    return reg


def write_textfile(cfg: NodeConfig, backend: TierBackend, path: str) -> None:
    """The node-exporter textfile, replaced atomically through fsafe (a FIFO or symlink planted at
    it or at its temporary name is replaced, never opened)."""
    fsafe.replace_own(path, generate_latest(registry(cfg, backend)), fsafe.FILE_MODE)


def samples(cfg: NodeConfig, backend: TierBackend) -> dict[str, float]:
    """Every sample as {'name{label=value,...}': value} (for --json)."""
    out: dict[str, float] = {}
    for fam in registry(cfg, backend).collect():
        for s in fam.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
            out[f"{s.name}{{{labels}}}"] = s.value
    return out
