"""Per-file proof that a committed checkpoint is archived, never an assumption.

Every file the manifest names, plus the marker itself (restore scans markers in Blob, so a
checkpoint whose marker is not archived could not be found again), must be proven:

* AMLFS: `lfs hsm_state` (batched across all checkpoints) says exists + archived and not
  dirty, lost or noarchive; and, whenever the archive is configured, the blob exists with the
  same size. An archive that is configured but unreachable proves nothing (UnavailableError):
  never delete on doubt.
* local: the blob exists with the same size and the xxh3-128 the exporter stored matches the
  manifest's (for the marker: the hash of the local marker file).
"""
from __future__ import annotations

import logging
import os
import stat
from collections.abc import Mapping
from dataclasses import dataclass, field

from tiered_ckpt.io.commit import CheckpointInfo
from tiered_ckpt.io.hashing import hash_path
from tiered_ckpt.io.marker import MARKER
from tiered_ckpt.logs import fields
from tiered_ckpt.tiers.backends import TierBackend
from tiered_ckpt.tiers.blob import BlobInfo
from tiered_ckpt.tiers.hsm import HsmState

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class FileProof:
    path: str                 # on the accelerator layer
    rel: str                  # relative to the root (the blob name without the prefix)
    archived: bool
    reason: str = ""          # why not, when not
    released: bool = False


@dataclass
class CheckpointProof:
    name: str
    files: list[FileProof] = field(default_factory=list)

    @property
    def archived(self) -> bool:
        return bool(self.files) and all(f.archived for f in self.files)

    @property
    def first_problem(self) -> FileProof | None:
        return next((f for f in self.files if not f.archived), None)

    @property
    def released(self) -> bool:
        data = [f for f in self.files if not f.rel.endswith("/" + MARKER)]
        return bool(data) and all(f.released for f in data)

    def blocked_reason(self) -> str:
        p = self.first_problem
        return "" if p is None else f"{p.rel} is not archived: {p.reason}"


def _expected(info: CheckpointInfo) -> list[tuple[str, int, str | None]]:
    """(path, size, xxh3) for every file to prove, the marker last."""
    assert info.manifest is not None
    base = str(info.path) + "/"
    out: list[tuple[str, int, str | None]] = [(base + f.path, f.size, f.hash) for f in info.manifest.files]
    marker = info.path / MARKER
    try:
        st = os.lstat(marker)       # lstat: a symlink planted there is not the marker
        size = st.st_size if stat.S_ISREG(st.st_mode) else -1
    except FileNotFoundError:       # deleted since the scan (status runs without the lock)
        size = -1
    out.append((str(marker), size, None))
    return out


def prove(backend: TierBackend, infos: list[CheckpointInfo],
          listing: Mapping[str, BlobInfo] | None = None) -> dict[str, CheckpointProof]:
    """Proofs for committed checkpoints (others are skipped), keyed by checkpoint name.

    `listing`: the caller's own BlobStore.listing of the checkpoints' models, so that a caller
    that needs it anyway (status) lists the archive once; it must be no older than `infos`.
    """
    committed = [c for c in infos if c.manifest is not None]
    if not committed:
        return {}
    expected = {c.name: _expected(c) for c in committed}
    all_paths = [p for exp in expected.values() for p, _, _ in exp]

    hsm = backend.hsm_states(all_paths)
    states: dict[str, HsmState] = {}
    hsm_errors: dict[str, str] = {}
    if hsm is not None:
        states, hsm_errors = hsm

    blobs: Mapping[str, BlobInfo] | None = None
    if listing is not None:
        blobs = listing
    elif hsm is None or backend.archive_configured:
        fetched: dict[str, BlobInfo] = {}
        for model in sorted({c.model for c in committed}):
            fetched.update(backend.store.listing(model))
        blobs = fetched

    local = hsm is None
    out: dict[str, CheckpointProof] = {}
    for c in committed:
        proof = CheckpointProof(c.name)
        for path, size, digest in expected[c.name]:
            rel = backend.rel(path)
            ok, reason, released = True, "", False
            if not local:
                st = states.get(path)
                if st is None:
                    ok, reason = False, f"lfs hsm_state failed: {hsm_errors.get(path, 'no answer')}"
                else:
                    released = st.released
                    if not st.archived:
                        ok, reason = False, st.why_not_archived()
            if ok and blobs is not None:
                b = blobs.get(rel)
                if b is None:
                    ok, reason = False, (
                        f"blob {backend.store.name(rel)} is missing"
                        + (" although lfs hsm_state says archived" if not local else "")
                    )
                elif b.size != size:
                    ok, reason = False, f"blob {b.name} has {b.size} bytes, expected {size}"
                elif local:
                    want = digest if digest is not None else hash_path(path)
                    if b.xxh3 is None:
                        ok, reason = False, f"blob {b.name} has no xxh3_128 metadata (upload not finished)"
                    elif b.xxh3 != want:
                        ok, reason = False, f"blob {b.name} content hash differs from the local file (changed since export)"
            proof.files.append(FileProof(path, rel, ok, reason, released))
        out[c.name] = proof
    if log.isEnabledFor(logging.DEBUG):      # status and retention prove on every run: DEBUG only
        for c in committed:
            p = out[c.name]
            log.debug("%s: %s", p.name, "proven archived" if p.archived else p.blocked_reason(),
                      extra=fields("prove", model=c.model, checkpoint=p.name,
                                   outcome="archived" if p.archived else "not archived"))
    return out
