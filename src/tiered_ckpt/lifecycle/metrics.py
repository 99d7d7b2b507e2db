"""Prometheus metrics of a model's checkpoints, from the tiers' state and the operation records.

Built with prometheus-client: `registry(cfg, backend)` is a CollectorRegistry whose collector looks
at the tiers on every collection (`status.gather`: markers, archive proof, backlog, export job,
capacity) and reads the last save/retention/restore records (tiered_ckpt.records). The CLI writes
it as a node-exporter textfile (`write_textfile`, atomic: prometheus-client writes a temporary
file and renames it) or serves it over HTTP (`tiered-ckpt metrics --serve`).

Every sample carries `model`. A part that could not be checked (the archive, the export job) is
reported by `tiered_ckpt_check_ok{part=...} 0` and its samples are left out, never shown as 0.
"""
from __future__ import annotations

import os
from collections.abc import Iterator
from datetime import datetime, timezone
from typing import Any

from prometheus_client import CollectorRegistry, write_to_textfile
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from tiered_ckpt import records
from tiered_ckpt.config import NodeConfig
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
}


class _Collector(Collector):
    def __init__(self, cfg: NodeConfig, backend: TierBackend) -> None:
        self.cfg, self.backend = cfg, backend

    def collect(self) -> Iterator[Metric]:
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
        yield from out.values()

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
        cfg = self.cfg
        s = records.read(cfg.root, cfg.model, records.SAVE)
        if s:
            put("save_seconds", s.get("seconds"))
            put("save_bytes", s.get("bytes"))
            if s.get("seconds"):
                put("save_throughput_bytes_per_second", float(s.get("bytes", 0)) / float(s["seconds"]))
            put("save_timestamp_seconds", s.get("time_unix"))
        a = records.read(cfg.root, cfg.model, records.ASYNC_SAVE)
        if a:
            put("async_blocked_seconds", a.get("blocked_seconds"))
        r = records.read(cfg.root, cfg.model, records.RETENTION)
        if r:
            totals = r.get("totals") or {}
            put("retention_deleted_total", totals.get("deleted", 0))
            put("retention_released_total", totals.get("released", 0))
            put("retention_blocked", r.get("blocked"))
            put("retention_timestamp_seconds", r.get("time_unix"))
        x = records.read(cfg.root, cfg.model, records.RESTORE)
        for path, last in ((x or {}).get("by_path") or {}).items():
            if path in RESTORE_PATHS and isinstance(last, dict):
                put("restore_seconds", last.get("seconds"), path=path)
                put("restore_bytes", last.get("bytes"), path=path)


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
    """A registry that collects the model's metrics afresh on every scrape or write."""
    reg = CollectorRegistry(auto_describe=False)
    reg.register(_Collector(cfg, backend))
    return reg


def write_textfile(cfg: NodeConfig, backend: TierBackend, path: str) -> None:
    """The node-exporter textfile (atomic replace)."""
    write_to_textfile(path, registry(cfg, backend))


def samples(cfg: NodeConfig, backend: TierBackend) -> dict[str, float]:
    """Every sample as {'name{label=value,...}': value} (for --json)."""
    out: dict[str, float] = {}
    for fam in registry(cfg, backend).collect():
        for s in fam.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
            out[f"{s.name}{{{labels}}}"] = s.value
    return out
