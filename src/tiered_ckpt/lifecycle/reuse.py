"""May a name be saved again? The lifecycle's part of a save's claim.

A name gone from the accelerator layer may still be committed in the archive: retention
deleted it after proving it archived (it left a tombstone, lifecycle/tombstone.py), or the
archive holds its marker. A save of such a name would make two checkpoints of one name on the
two tiers, so it is refused (ConflictError). The writer calls `claim_checks` while it holds
the name's claim (io/lock.py), after it checked the local marker itself, before it writes
anything; the same call drops retention's delete-journal entry of the name, so an interrupted
delete can never finish on the new checkpoint.

The archive is asked once, with short timeouts. If it cannot be asked, the save goes on with
a logged warning: training must not stop for the archive, and unique file names per save
(io/layout.py) mean no archived blob can be overwritten either way.
"""
from __future__ import annotations

import logging
import os
from collections.abc import Callable
from dataclasses import replace

from tiered_ckpt.config import ArchiveConfig
from tiered_ckpt.errors import ConflictError
from tiered_ckpt.io.commit import MARKER
from tiered_ckpt.lifecycle import journal, tombstone
from tiered_ckpt.redact import redact

log = logging.getLogger(__name__)


def committed_in_archive(archive: ArchiveConfig | None, model: str, name: str) -> bool:
    """Whether Blob holds this name's marker; False (with a warning) if the archive cannot be asked."""
    if archive is None or not (archive.connection_string or archive.account_url):
        return False
    try:
        from tiered_ckpt.tiers import blob as blobstore  # the azure SDK only where an archive is configured

        # One attempt, short timeouts: a save must not wait minutes for an unreachable archive.
        store = blobstore.BlobStore(replace(archive, retries=0), connection_timeout=5.0, read_timeout=15.0)
        return store.exists(f"{model}/{name}/{MARKER}")
    except Exception as e:  # noqa: BLE001 - any failure to ask means "unknown", never "stop training"
        msg = str(e).splitlines()[0][:300] if str(e) else type(e).__name__
        log.warning("could not check whether %s is committed in the archive (%s); saving anyway: file names are "
                    "unique per save, so no archived file can be overwritten", name, redact(msg))
        return False


def claim_checks(root: str | os.PathLike[str], model: str, name: str, archive: ArchiveConfig | None) -> None:
    """ConflictError if `name` is committed in the archive; else drop its delete-journal entry."""
    if tombstone.present(root, model, name):
        raise ConflictError(
            f"{name} is committed in the archive (retention deleted it here after archiving it: "
            f"{tombstone.tombstone_path(root, model, name)}); committed checkpoints are never "
            f"overwritten — save under another epoch/step, or bring it back with `tiered-ckpt restore {name}`"
        )
    if committed_in_archive(archive, model, name):
        raise ConflictError(
            f"{name} is committed in the archive ({model}/{name}/{MARKER} exists in Blob); "
            "committed checkpoints are never overwritten — save under another epoch/step, or bring it back with "
            f"`tiered-ckpt restore {name}`"
        )
    journal.forget(root, model, name)


def checks_for(root: str | os.PathLike[str], model: str, name: str, archive: ArchiveConfig | None) -> Callable[[], None]:
    """The writer's `name_check` for one save."""
    return lambda: claim_checks(root, model, name, archive)
