"""Retention of the archive (Blob): the keep policy applied to the checkpoints committed there.

Deletes never propagate from Lustre to Blob (AMLFS auto-export copies new and changed files;
removing a file on Lustre leaves its blob), so without retention of its own the archive only
grows, and an age-based lifecycle rule is the only brake: one that deletes by last write also
deletes the newest and only checkpoints of a campaign that was paused. This module knows what a
checkpoint is and applies the same keep rules and guards (policy.decide) to the archive's
committed checkpoints: never the newest `min_keep` committed, never one that is not committed
in the archive (no valid marker, or a listed file missing or of another size: it may be an
export still in flight), never one still present on the accelerator layer (its archive copy is
what lets Lustre retention free it, and a released file's only data).

Apply, per checkpoint to delete, in this order (each step idempotent):

1. write a journal blob `<journal>/<model>/<name>.json` (outside the checkpoint prefix, so AMLFS
   never imports it into Lustre); then, if a restore holds a live lease on the checkpoint
   (restore_lease.py: the restore is reading it from the archive), keep it this run and drop
   the journal blob — a restore that starts later sees the journal blob and stops instead;
2. delete the marker blob, only if it is still the version the decision read (If-Match on its
   ETag) — from here on no reader counts the checkpoint: `restore` picks only committed ones;
3. delete the data blobs listed under the checkpoint;
4. delete the journal blob.

A run killed anywhere leaves either a committed checkpoint (untouched: step 2 not done) or a
journal entry with no marker, which the next run finishes ("resume-delete"). A directory without
a marker and without a journal entry is never touched: it may be an export in progress.
"""
from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from tiered_ckpt.config import NodeConfig
from tiered_ckpt.errors import ConfigError
from tiered_ckpt.io.marker import MARKER, Manifest
from tiered_ckpt.lifecycle import restore_lease
from tiered_ckpt.lifecycle.policy import DELETE, KEEP, RESUME, Candidate, Decision, Policy, decide
from tiered_ckpt.lifecycle.retention import ApplyResult, RetentionDecisions
from tiered_ckpt.logs import fields
from tiered_ckpt.naming import parse_name
from tiered_ckpt.tiers.blob import BlobInfo, BlobStore, archived_markers

JOURNAL_PREFIX = restore_lease.JOURNAL_PREFIX
RESTORING = "a restore of it is reading it from the archive (its lease, restore_lease.py): kept while it runs"
ON_LUSTRE = "still on the accelerator layer: its archive copy proves it archived (Lustre retention frees it first)"

log = logging.getLogger(__name__)


@dataclass
class ArchiveFacts:
    """What one evaluation saw in the archive for one model."""

    candidates: list[Candidate]
    listing: dict[str, BlobInfo]


def _journal(store: BlobStore) -> BlobStore:
    return restore_lease.journal(store)


def _journaled(store: BlobStore, model: str) -> set[str]:
    return {rel.split("/")[1].removesuffix(".json") for rel in _journal(store).listing(model)
            if rel.count("/") == 1 and rel.endswith(".json")}


def _created(m: Manifest) -> datetime | None:
    try:
        t = datetime.fromisoformat(m.created_utc)
    except (TypeError, ValueError):
        return None
    return t if t.tzinfo else t.replace(tzinfo=timezone.utc)


def gather(cfg: NodeConfig, store: BlobStore) -> ArchiveFacts:
    """Every checkpoint of the model in the archive, as policy candidates (no change)."""
    model = cfg.model
    listing = store.listing(model)
    dirs: dict[str, int] = {}
    for rel, info in listing.items():
        parts = rel.split("/")
        if len(parts) >= 3 and parse_name(parts[1], cfg.naming) is not None:
            dirs[parts[1]] = dirs.get(parts[1], 0) + info.size
    journaled = _journaled(store, model)
    out: dict[str, Candidate] = {}
    for am in archived_markers(store, {r: i for r, i in listing.items() if r.startswith(model + "/")}, cfg.naming):
        if am.model != model:
            continue
        cid = parse_name(am.name, cfg.naming)
        assert cid is not None
        why = am.problem or None
        if am.manifest is not None:
            for f in am.manifest.files:
                got = listing.get(f"{model}/{am.name}/{f.path}")
                if got is None or got.size != f.size:
                    why = f"{f.path} is {'missing' if got is None else f'{got.size} bytes, marker says {f.size}'} in the archive"
                    break
        out[am.name] = Candidate(am.name, cid, committed=why is None, archived=True, bytes=dirs.get(am.name, 0),
                                 created_utc=_created(am.manifest) if am.manifest else None,
                                 journaled=am.name in journaled, why_not=why)
    for name, size in dirs.items():
        if name not in out:
            cid = parse_name(name, cfg.naming)
            assert cid is not None
            out[name] = Candidate(name, cid, committed=False, archived=True, bytes=size, journaled=name in journaled,
                                  why_not=None if name in journaled else "no marker in the archive (an export in progress?)")
    for name in journaled - set(out):       # journal left after the last blob went: finish it
        cid = parse_name(name, cfg.naming)
        if cid is not None:
            out[name] = Candidate(name, cid, committed=False, archived=True, journaled=True)
    return ArchiveFacts(list(out.values()), listing)


def on_lustre(cfg: NodeConfig, lustre_gone: bool = False) -> Callable[[str], bool]:
    """Whether a checkpoint directory exists on the accelerator layer.

    Deleting the archive copy of a checkpoint that is on Lustre, possibly released (its data only
    in Blob), would lose it; so the root must be mounted here, unless the operator says the file
    system is gone (`--lustre-gone`, after a teardown).
    """
    base = Path(cfg.root) / cfg.model
    if lustre_gone:
        return lambda name: False
    if not Path(cfg.root).is_dir():
        raise ConfigError(
            f"archive retention: the checkpoint root {cfg.root} is not mounted here, so it cannot tell which archived "
            "checkpoints are still on Lustre (deleting their archive copy could lose released data); run it on a node "
            "or the login node, or pass --lustre-gone if the file system was torn down"
        )

    def check(name: str) -> bool:
        return (base / name).exists() or (base / name).is_symlink()

    return check


def evaluate(cfg: NodeConfig, store: BlobStore, policy: Policy, present: Callable[[str], bool],
             now: datetime | None = None) -> tuple[RetentionDecisions, ArchiveFacts]:
    """The policy's decision for every archived checkpoint of the model; changes nothing.
    `present(name)`: the checkpoint is on the accelerator layer (on_lustre)."""
    now = now or datetime.now(timezone.utc)
    facts = gather(cfg, store)
    # The archive has no "release": anything the rules let go is deleted from it.
    decisions = decide(facts.candidates, replace(policy, action=DELETE), now)
    decisions = [Decision(d.name, KEEP, (ON_LUSTRE,), d.bytes) if d.action in (DELETE, RESUME) and present(d.name) else d
                 for d in decisions]
    leased = {rel.split("/")[1].removesuffix(".json") for rel, info in restore_lease.leases(store).listing(cfg.model).items()
              if rel.count("/") == 1 and (info.last_modified is None
                                          or time.time() - info.last_modified < restore_lease.LEASE_SECONDS)}
    decisions = [Decision(d.name, KEEP, (RESTORING,), d.bytes) if d.action == DELETE and d.name in leased else d
                 for d in decisions]
    ev = RetentionDecisions(cfg.model, policy, decisions, now.isoformat())
    return ev, facts


def apply(cfg: NodeConfig, store: BlobStore, policy: Policy, present: Callable[[str], bool],
          now: datetime | None = None, on_step: Callable[[str, str], None] | None = None) -> ApplyResult:
    """Delete what evaluate() allows, marker first (module doc). `on_step(name, step)` is called
    before each step ("journal", "marker", "data", "done"); tests use it to kill a run mid-way."""
    t0 = time.monotonic()
    try:
        res = _apply(cfg, store, policy, present, now, on_step)
    except Exception as e:
        log.error("archive retention of %s failed: %s", cfg.model, e,
                  extra=fields("archive retention", model=cfg.model, duration_s=time.monotonic() - t0,
                               outcome="error"))
        raise
    for done in res.done:
        name = done.partition(" ")[2]
        log.info("archive retention deleted %s from the archive", name,
                 extra=fields("archive retention delete", model=cfg.model, checkpoint=name))
    log.info("archive retention of %s: %d deleted (%d bytes)", cfg.model, len(res.done), res.freed_bytes,
             extra=fields("archive retention", model=cfg.model, duration_s=time.monotonic() - t0,
                          nbytes=res.freed_bytes, deleted=len(res.done)))
    return res


def _apply(cfg: NodeConfig, store: BlobStore, policy: Policy, present: Callable[[str], bool],
           now: datetime | None, on_step: Callable[[str, str], None] | None) -> ApplyResult:
    ev, facts = evaluate(cfg, store, policy, present, now)
    res = ApplyResult(ev)
    step = on_step or (lambda name, what: None)
    stale = {c.name for c in facts.candidates if c.committed and c.journaled}
    out: list[Decision] = []
    for d in ev.decisions:
        if d.name in stale and d.action != DELETE:
            # Killed after its journal entry, before its marker went, and now kept: the entry must
            # not let a later run delete a new export of the same name.
            _journal(store).delete(f"{cfg.model}/{d.name}.json")
        if d.action == DELETE:
            d = _delete(cfg, store, facts, d, step, res)
        elif d.action == RESUME:
            d = _finish(cfg, store, facts, d, step, res)
        out.append(d)
    res.evaluated = replace(ev, decisions=out)
    return res


def _data(facts: ArchiveFacts, model: str, name: str) -> list[str]:
    base = f"{model}/{name}/"
    return sorted(r for r in facts.listing if r.startswith(base) and r != base + MARKER)


def _delete(cfg: NodeConfig, store: BlobStore, facts: ArchiveFacts, d: Decision,
            step: Callable[[str, str], None], res: ApplyResult) -> Decision:
    model, name = cfg.model, d.name
    marker_rel = f"{model}/{name}/{MARKER}"
    got = store.get_with_etag(marker_rel)
    if got is None:
        return Decision(name, KEEP, ("its marker disappeared since the evaluation: decided again next run",), d.bytes)
    step(name, "journal")
    _journal(store).put_bytes(f"{model}/{name}.json", json.dumps(
        {"model": model, "name": name, "started_utc": datetime.now(timezone.utc).isoformat()}).encode())
    # After the journal entry, before the marker: a restore that took its lease first is seen
    # here; one that takes it later sees the entry and stops (restore_lease).
    step(name, "lease")
    age = restore_lease.restoring(store, model, name)
    if age is not None:
        _journal(store).delete(f"{model}/{name}.json")
        return Decision(name, KEEP, (f"a restore of it started {age:.0f} s ago and may still be reading it: kept this "
                                     "run",), d.bytes)
    step(name, "marker")
    if store.delete(marker_rel, etag=got[1]) == "changed":
        _journal(store).delete(f"{model}/{name}.json")
        return Decision(name, KEEP, ("its marker changed since the evaluation (re-exported?): decided again next run",), d.bytes)
    return _finish(cfg, store, facts, d, step, res)


def _finish(cfg: NodeConfig, store: BlobStore, facts: ArchiveFacts, d: Decision,
            step: Callable[[str, str], None], res: ApplyResult) -> Decision:
    model, name = cfg.model, d.name
    if store.get_with_etag(f"{model}/{name}/{MARKER}") is not None:
        # A marker is back (the checkpoint was exported again): it is committed, keep it.
        _journal(store).delete(f"{model}/{name}.json")
        return Decision(name, KEEP, ("committed again since an earlier apply started deleting it: kept",), d.bytes)
    step(name, "data")
    for rel in _data(facts, model, name):
        store.delete(rel)
    step(name, "done")
    _journal(store).delete(f"{model}/{name}.json")
    res.done.append(f"delete {name}")
    res.freed_bytes += d.bytes
    return d


def to_json(res: ApplyResult | RetentionDecisions) -> dict[str, Any]:
    return {"tier": "archive", **res.to_json()}
