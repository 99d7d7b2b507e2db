"""What happened to each checkpoint of a model, and when: the data `tiered-ckpt timeline` draws.

Gathered from the toolkit's own records only, for the checkpoints on both tiers:

* write: the save's history record (tiered_ckpt.records: end time and duration), else the
  marker's `created_utc` as an instant (a checkpoint written by another tool, or whose record
  was lost);
* archive: commit .. proven archived. The end is the newest Last-Modified of the checkpoint's
  blobs (its files and its marker, once every one is proven: size, and locally the xxh3-128
  metadata); a checkpoint not proven yet is an open span with the reason it is not;
* retention: each delete / release / blocked decision of a retention run, from the history
  (a run of identical decisions is shown once, at its first time), else the tombstone that a
  delete leaves (lifecycle/tombstone.py);
* restore: each restore's path (resident / released / import / download) and duration;
* memory: a save into the memory tier (node RAM, tiered_ckpt.memory_tier): its commit on every
  rank, with its peer replica and whether it was persisted to the root (a persisted one has its
  write too, at the time of the persist).

Checkpoints only in the archive come from the one listing of the model's blobs that the proof
needs anyway. Nothing here renders (the command line draws it, with matplotlib, and
`status --watch` shows it as a table); a part that could not be read is a warning, never an
error, so a timeline is there even when the archive is unreachable.
"""
from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from typing import Any

from tiered_ckpt import records
from tiered_ckpt.errors import UserError
from tiered_ckpt.io import commit, fsafe
from tiered_ckpt.io.marker import MARKER
from tiered_ckpt.lifecycle import tombstone
from tiered_ckpt.lifecycle.proof import CheckpointProof, prove
from tiered_ckpt.lifecycle.restore import archive_committed
from tiered_ckpt.naming import CheckpointId, parse_name
from tiered_ckpt.tiers.backends import TierBackend
from tiered_ckpt.tiers.blob import BlobInfo

WRITE, ARCHIVE, RETENTION, RESTORE, MEMORY = "write", "archive", "retention", "restore", "memory"
KIND_ORDER = {MEMORY: 0, WRITE: 1, ARCHIVE: 2, RETENTION: 3, RESTORE: 4}
PENDING = "pending"        # the action of an archive span not proven yet (its end is None)


@dataclass(frozen=True)
class Event:
    kind: str                        # write | archive | retention | restore | memory
    checkpoint: str
    start_unix: float
    end_unix: float | None = None    # None: an instant, or (archive, action "pending") still open
    action: str = ""                 # retention: delete | release | blocked | ...; restore: its path
    detail: str = ""
    bytes: int | None = None

    @property
    def seconds(self) -> float | None:
        return None if self.end_unix is None else self.end_unix - self.start_unix

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "seconds": self.seconds}


@dataclass
class Timeline:
    model: str
    root: str
    generated_unix: float
    since_unix: float | None = None
    events: list[Event] = field(default_factory=list)
    tiers: dict[str, str] = field(default_factory=dict)    # checkpoint -> where it is now
    warnings: list[str] = field(default_factory=list)

    def checkpoints(self) -> list[str]:
        """The checkpoints with an event, in the order of their first event."""
        seen: dict[str, None] = {}
        for e in self.events:
            seen.setdefault(e.checkpoint, None)
        return list(seen)

    def of(self, name: str, kind: str) -> list[Event]:
        return [e for e in self.events if e.checkpoint == name and e.kind == kind]

    def to_json(self) -> dict[str, Any]:
        return {"model": self.model, "root": self.root, "generated_unix": self.generated_unix,
                "since_unix": self.since_unix, "events": [e.to_json() for e in self.events],
                "tiers": self.tiers, "warnings": self.warnings}


def _unix(iso: str) -> float | None:
    try:
        t = datetime.fromisoformat(iso.replace("Z", "+00:00"))
    except (ValueError, AttributeError):
        return None
    return (t if t.tzinfo else t.replace(tzinfo=timezone.utc)).timestamp()


def _newest(blobs: dict[str, BlobInfo], rels: list[str]) -> float | None:
    times = [b.last_modified for r in rels if (b := blobs.get(r)) is not None]
    return None if not times or None in times else max(t for t in times if t is not None)


def _tombstones(root: str, model: str) -> dict[str, tuple[float, str]]:
    """name -> (when retention deleted it locally, created_utc) from the tombstones."""
    d = tombstone.tombstone_dir(root, model)
    out: dict[str, tuple[float, str]] = {}
    if not fsafe.is_real_dir(d):
        return out
    for e in os.scandir(d):
        try:
            info = json.loads(fsafe.read_file(d / e.name, anchor=root, limit=4096))
        except (OSError, ValueError):
            continue
        t = _unix(str(info.get("recorded_utc", ""))) if isinstance(info, dict) else None
        if t is not None:
            out[e.name] = (t, str(info.get("created_utc", "")))
    return out


def _history_events(hist: list[dict[str, Any]]) -> list[Event]:
    out: list[Event] = []
    last_decision: dict[str, tuple[str, str]] = {}
    blocked: dict[str, float] = {}          # async saves: how long the caller waited, by name
    for r in hist:
        t = float(r["time_unix"])
        kind = r.get("kind")
        if kind == records.ASYNC_SAVE and isinstance(r.get("name"), str):
            blocked[r["name"]] = float(r.get("blocked_seconds") or 0.0)
        elif kind == records.SAVE and isinstance(r.get("name"), str):
            secs = float(r.get("seconds") or 0.0)
            waited = blocked.pop(r["name"], None)
            how = "save" if waited is None else "async_save"
            detail = f"{r.get('files', '?')} files, world size {r.get('world_size', '?')}" + (
                "" if waited is None else f", caller blocked {waited:.2f}s")
            out.append(Event(WRITE, r["name"], t - secs, t, how, detail, int(r.get("bytes") or 0)))
            last_decision.pop(r["name"], None)     # a new checkpoint of that name: its decisions start afresh
        elif kind == records.RETENTION:
            for d in r.get("decisions") or []:
                if not isinstance(d, dict) or not isinstance(d.get("name"), str):
                    continue
                key = (str(d.get("action", "")), str(d.get("reason", "")))
                if last_decision.get(d["name"]) == key:
                    continue        # the timer decided the same again: shown once, at its first time
                last_decision[d["name"]] = key
                out.append(Event(RETENTION, d["name"], t, None, key[0], key[1]))
        elif kind == records.MEMORY and isinstance(r.get("name"), str):
            end = float(r.get("committed_unix") or t)
            rs = r.get("replica_seconds")
            detail = ", ".join([f"world size {r.get('world_size', '?')}",
                                f"peer replica after {float(rs):.2f}s" if isinstance(rs, (int, float)) else "no peer replica",
                                "persisted to the root" if r.get("persisted") else "not persisted"])
            out.append(Event(MEMORY, r["name"], end - float(r.get("seconds") or 0.0), end, "memory", detail))
        elif kind == records.RESTORE and isinstance(r.get("last"), dict):
            last = r["last"]
            if isinstance(last.get("name"), str):
                last_decision.pop(last["name"], None)   # back on the accelerator layer: a later delete is news
                secs = float(last.get("seconds") or 0.0)
                out.append(Event(RESTORE, last["name"], t - secs, t, str(last.get("path", "")), "",
                                 int(last.get("bytes") or 0)))
    return out


def gather(backend: TierBackend, since_unix: float | None = None, now: float | None = None) -> Timeline:
    """The model's timeline; `since_unix`: only what ended (or is still open) at or after it."""
    cfg = backend.cfg
    commit.require_root(cfg.root)
    now = time.time() if now is None else now
    tl = Timeline(cfg.model, str(cfg.root), now, since_unix)
    infos = commit.scan(cfg.root, cfg.model, cfg.naming)
    committed = {c.name: c for c in infos if c.manifest is not None}
    for c in infos:
        if c.manifest is None:
            tl.tiers[c.name] = "in flight" if c.invalid is None else "invalid"

    blobs: dict[str, BlobInfo] | None = None
    if backend.archive_configured:
        try:
            blobs = backend.store.listing(cfg.model)
        except UserError as e:
            tl.warnings.append(f"archive listing unavailable (archive times and archive-only checkpoints left out): {e}")
    proofs: dict[str, CheckpointProof] = {}
    if blobs is not None or not backend.archive_configured:
        try:
            proofs = prove(backend, list(committed.values()), blobs)
        except UserError as e:
            tl.warnings.append(f"archive proof unavailable: {e}")

    events = _history_events(records.history(cfg.root, cfg.model))
    written = {e.checkpoint: e for e in events if e.kind == WRITE}    # the newest save of each name
    # name -> (commit time, blob names); the local copy wins over the archived one of the same name
    commits: dict[str, tuple[float | None, list[str]]] = {}
    if blobs is not None:
        try:
            for m in archive_committed(backend.store, cfg.model, blobs, cfg.naming):
                if m.name not in committed:
                    tl.tiers[m.name] = "only in archive"
                    rels = [f"{cfg.model}/{m.name}/{f.path}" for f in m.files] + [f"{cfg.model}/{m.name}/{MARKER}"]
                    commits[m.name] = (_unix(m.created_utc), rels)
        except UserError as e:
            tl.warnings.append(f"archive-only checkpoints unavailable: {e}")
    for name, c in committed.items():
        assert c.manifest is not None
        p = proofs.get(name)
        rels = [f.rel for f in p.files] if p is not None else []
        commits[name] = (_unix(c.manifest.created_utc), rels)
        if p is None:
            tl.tiers[name] = "resident"
        elif p.released:
            tl.tiers[name] = "released"
        elif p.archived:
            tl.tiers[name] = "archived"
        else:
            tl.tiers[name] = "not yet archived"

    for name, (created, rels) in commits.items():
        w = written.get(name)
        committed_at = w.end_unix if w is not None else created
        if committed_at is None:
            continue
        if w is None:
            events.append(Event(WRITE, name, committed_at, committed_at, "commit",
                                "write start unknown (no save record): the marker's time"))
        p = proofs.get(name)
        tier = tl.tiers.get(name)
        if tier in ("archived", "released", "only in archive"):
            done = _newest(blobs, rels) if blobs is not None else None
            if done is not None:
                events.append(Event(ARCHIVE, name, committed_at, max(done, committed_at), "proven"))
        elif p is not None:
            events.append(Event(ARCHIVE, name, committed_at, None, PENDING, p.blocked_reason()))

    for ev in events:
        if ev.kind == MEMORY and ev.checkpoint not in tl.tiers:
            tl.tiers[ev.checkpoint] = "memory tier only"      # node RAM; never written to the root
    deleted = {e.checkpoint for e in events if e.kind == RETENTION and e.action == "delete"}
    try:
        for name, (t, _) in _tombstones(str(cfg.root), cfg.model).items():
            if name not in deleted:
                events.append(Event(RETENTION, name, t, None, "delete", "archived; deleted locally (tombstone)"))
    except OSError as e:
        tl.warnings.append(f"tombstones unreadable: {e}")

    if since_unix is not None:
        events = [e for e in events if (e.end_unix if e.end_unix is not None else
                                        now if e.action == PENDING else e.start_unix) >= since_unix]

    def order(e: Event) -> tuple[float, int, CheckpointId]:
        return (e.start_unix, KIND_ORDER.get(e.kind, 9), parse_name(e.checkpoint, cfg.naming) or CheckpointId(0, 0))

    tl.events = sorted(events, key=order)
    return tl
