"""May a name be saved again? The lifecycle's part of a save's claim.

A name gone from the accelerator layer may still be committed in the archive: retention
deleted it after proving it archived (it left a tombstone, lifecycle/tombstone.py), or the
archive holds its marker. A save of such a name would make two checkpoints of one name on the
two tiers, so it is refused (ConflictError). The writer calls `claim_checks` while it holds
the name's claim (io/lock.py), after it checked the local marker itself, before it writes
anything; the same call drops retention's delete-journal entry of the name, so an interrupted
delete can never finish on the new checkpoint.

The archive is asked once, with short timeouts. If it cannot be asked, the save is refused
(UnavailableError, nothing written): the archive's marker of a name is `COMMITTED.json` for
every save of it, so a save of a name the archive holds would have its marker exported over the
archived one, and the original would be lost. A caller that would rather save than stop passes
archive_check="best_effort" (tc.save, TieredWriter, save_training, TieredCheckpointIO): the save
then goes on with a logged warning naming that risk. docs/decisions.md says why not a per-save
marker name instead.
"""
from __future__ import annotations

import logging
import os
from collections.abc import Callable
from dataclasses import replace

from tiered_ckpt.config import ArchiveConfig
from tiered_ckpt.errors import ConflictError, UnavailableError, UserError
from tiered_ckpt.io.marker import MARKER
from tiered_ckpt.lifecycle import journal, tombstone
from tiered_ckpt.redact import redact

log = logging.getLogger(__name__)


# What a save does when the archive cannot be asked whether its name is committed there.
ARCHIVE_CHECKS = ("required", "best_effort")


def require_archive_check(value: object) -> str:
    if value not in ARCHIVE_CHECKS:
        raise UserError(f"archive_check={str(value)[:80]!r}: must be 'required' (refuse a save whose name cannot be "
                        "checked against the archive; the default) or 'best_effort' (save anyway, with a warning)")
    return str(value)


def committed_in_archive(archive: ArchiveConfig | None, model: str, name: str, archive_check: str = "required") -> bool:
    """Whether Blob holds this name's marker (False where no archive is configured).

    If the archive cannot be asked: UnavailableError, or with archive_check="best_effort" False
    and a warning."""
    if archive is None or not (archive.connection_string or archive.account_url):
        return False
    try:
        from tiered_ckpt.tiers import blob as blobstore  # the azure SDK only where an archive is configured

        # One attempt, short timeouts: a save must not wait minutes for an unreachable archive.
        store = blobstore.BlobStore(replace(archive, retries=0), connection_timeout=5.0, read_timeout=15.0)
        return store.exists(f"{model}/{name}/{MARKER}")
    except Exception as e:  # noqa: BLE001 - any failure to ask means "unknown"
        msg = redact(str(e).splitlines()[0][:300] if str(e) else type(e).__name__)
        if archive_check != "best_effort":
            raise UnavailableError(
                f"cannot save {name}: the archive could not be asked whether {name} is committed there ({msg}); "
                f"saving it could replace the archived {model}/{name}/{MARKER} (every save of a name exports its "
                "marker under that one blob name). Nothing was written. Retry once the archive is reachable "
                "(tiered-ckpt status shows it), save under a name never saved before, or pass "
                "archive_check='best_effort' to save anyway") from None
        log.warning("could not check whether %s is committed in the archive (%s); saving anyway "
                    "(archive_check='best_effort'): if the archive holds %s, its COMMITTED.json will be replaced "
                    "by this save's at the next export", name, msg, name)
        return False


def claim_checks(root: str | os.PathLike[str], model: str, name: str, archive: ArchiveConfig | None,
                 archive_check: str = "required") -> None:
    """ConflictError if `name` is committed in the archive (UnavailableError if that cannot be
    learnt, unless archive_check="best_effort"); else drop its delete-journal entry."""
    if tombstone.present(root, model, name):
        raise ConflictError(
            f"{name} is committed in the archive (retention deleted it here after archiving it: "
            f"{tombstone.tombstone_path(root, model, name)}); committed checkpoints are never "
            f"overwritten — save under another epoch/step, or bring it back with `tiered-ckpt restore {name}`"
        )
    if committed_in_archive(archive, model, name, archive_check):
        raise ConflictError(
            f"{name} is committed in the archive ({model}/{name}/{MARKER} exists in Blob); "
            "committed checkpoints are never overwritten — save under another epoch/step, or bring it back with "
            f"`tiered-ckpt restore {name}`"
        )
    journal.forget(root, model, name)


def checks_for(root: str | os.PathLike[str], model: str, name: str, archive: ArchiveConfig | None,
               archive_check: str = "required") -> Callable[[], None]:
    """The `name_check` every writer passes to its claim (io/claim.py) for one save."""
    archive_check = require_archive_check(archive_check)
    return lambda: claim_checks(root, model, name, archive, archive_check)
