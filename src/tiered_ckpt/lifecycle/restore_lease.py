"""Archive retention and restores from the archive exclude each other, in the archive's terms.

A restore of a checkpoint that is only in the archive downloads (or imports) its blobs; archive
retention deleting that checkpoint meanwhile would fail the restore. Lustre's flock cannot
arbitrate (archive retention may run where Lustre is not mounted, `--lustre-gone`), so each
side writes a small blob of its own and then looks for the other's, the order that lets two
parties exclude each other with nothing but a consistent store (Blob storage is strongly
consistent: a read after a completed write sees it):

* a restore writes its lease `<LEASE_PREFIX>/<prefix>/<model>/<name>.json`, then looks for
  archive retention's journal entry of that name (written before retention deletes anything):
  one younger than JOURNAL_LIVE_SECONDS means a delete may be under way, and the restore stops
  (its lease removed) with a message to re-run or pick another checkpoint;
* archive retention writes its journal entry, then looks for a lease of that name younger than
  LEASE_SECONDS: one means a restore is reading the checkpoint, and retention keeps it this run
  (journal entry removed).

Whichever writes second sees the first's blob, so at most one of them proceeds. A restore
removes its lease when it ends, however it ends; a killed restore's lease stops protecting after
LEASE_SECONDS. Blob ages are the service's Last-Modified times, so clocks of the nodes never matter.
"""
from __future__ import annotations

import json
import os
import socket
import time
from datetime import datetime, timezone

from tiered_ckpt.tiers.blob import BlobStore

# Container-level prefixes, outside archive.prefix (the checkpoint root AMLFS imports), so that
# neither ever appears on Lustre.
JOURNAL_PREFIX = ".tiered-ckpt/archive-retention"
LEASE_PREFIX = ".tiered-ckpt/restores"
# A lease older than this is a killed restore's: a download of even a large checkpoint ends sooner.
LEASE_SECONDS = 6 * 3600.0
# Archive retention writes its journal entry and deletes the marker blob a request later; an entry
# older than this whose marker is still there is a killed run's (the next run clears it).
JOURNAL_LIVE_SECONDS = 600.0


def _under(store: BlobStore, prefix: str) -> BlobStore:
    return store.at(f"{prefix}/{store.prefix}" if store.prefix else prefix)


def journal(store: BlobStore) -> BlobStore:
    """Archive retention's journal of deletes in progress."""
    return _under(store, JOURNAL_PREFIX)


def leases(store: BlobStore) -> BlobStore:
    return _under(store, LEASE_PREFIX)


def _age(store: BlobStore, model: str, name: str) -> float | None:
    """Seconds since the blob `<model>/<name>.json` of `store` was written, None if absent."""
    info = store.listing(model).get(f"{model}/{name}.json")
    if info is None:
        return None
    return max(0.0, time.time() - info.last_modified) if info.last_modified is not None else 0.0


def take(store: BlobStore, model: str, name: str) -> None:
    leases(store).put_bytes(f"{model}/{name}.json", json.dumps(
        {"model": model, "name": name, "host": socket.gethostname(), "pid": os.getpid(),
         "started_utc": datetime.now(timezone.utc).isoformat()}).encode())


def release(store: BlobStore, model: str, name: str) -> None:
    leases(store).delete(f"{model}/{name}.json")


def restoring(store: BlobStore, model: str, name: str) -> float | None:
    """Seconds since a restore of `name` took its lease, None when no live lease is there."""
    age = _age(leases(store), model, name)
    return age if age is not None and age < LEASE_SECONDS else None


def being_deleted(store: BlobStore, model: str, name: str) -> float | None:
    """Seconds since archive retention journaled a delete of `name`, None when none is live."""
    age = _age(journal(store), model, name)
    return age if age is not None and age < JOURNAL_LIVE_SECONDS else None
