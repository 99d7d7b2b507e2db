"""The one claim-and-commit path of every writer: how a name is taken, and how a save becomes final.

`tc.save`/`tc.async_save` (io/writer.py), the DCP writer (tiered_ckpt.dcp.TieredWriter) and
everything on it (`save_training`, Lightning's TieredCheckpointIO) call exactly this; none has
a copy of any step. In order, by rank 0 / the DCP coordinator, before anything is written:

1. take the name's lock (io/lock.py `checkpoint_lock`, wait=0): a second saver of the name
   gets ConflictError at once and has created nothing, so it removes nothing either;
2. refuse a name whose directory holds a valid marker (committed here; sizes are not
   consulted: a damaged committed checkpoint is still never replaced);
3. run the caller's `name_check` (lifecycle/reuse.py's: refuse a name committed in the
   archive, or one whose archive state cannot be learnt unless the caller allowed that;
   drop retention's delete-journal entry of the name) — io knows nothing of the tiers;
4. open (create) the checkpoint directory, remembering whether this save created it;
5. remove what earlier, never-committed saves of the name left (`keep` spares the files
   another rank of this very save may already be writing); a directory inside is refused;
6. draw the attempt's nonce: a part manifest counts only if it carries it, so a part left
   by a crashed earlier attempt that reused the save id is never committed.

`Claim.commit` then makes the new directory entries durable and writes ``COMMITTED.json``
(O_EXCL, explicit mode, fsynced with its directory). `Claim.abandon` ends a failed save: it
removes the checkpoint directory only if this save created it and it is empty (a loser of a
claim race never touches the winner's directory), then releases the lock.
"""
from __future__ import annotations

import os
import stat
import uuid
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path

from tiered_ckpt.errors import EXIT_CONFLICT, ConflictError, UserError
from tiered_ckpt.io import commit, lock
from tiered_ckpt.io.marker import MARKER, Manifest
from tiered_ckpt.io.posix import fsync_parents, open_subdir, os_error
from tiered_ckpt.io.save_commit import valid_marker
from tiered_ckpt.naming import CheckpointId


def new_nonce() -> str:
    return uuid.uuid4().hex


class Claim:
    """Rank 0's hold on one checkpoint name, from before its first file to its marker (module doc)."""

    def __init__(self, root: Path, model: str, cid: CheckpointId) -> None:
        self.root, self.model, self.cid = root, model, cid
        self.mdir = root / model
        self.dir = self.mdir / cid.name
        self.dfd: int | None = None          # the checkpoint directory, opened without following anything
        self.created = False                 # this save created the directory
        self.nonce = new_nonce()
        self.committed = False
        self._lock: ExitStack | None = None

    # -- taking --------------------------------------------------------------------------------
    @classmethod
    def take(cls, root: str | os.PathLike[str], model: str, cid: CheckpointId, *,
             name_check: Callable[[], None] | None = None, keep: Callable[[str], bool] | None = None,
             overwrite_incomplete: bool = True) -> Claim:
        """Steps 1-6 of the module doc; raises (having released everything) if any fails."""
        commit.require_root(root)
        c = cls(Path(root), model, cid)
        try:
            c._take(name_check, keep, overwrite_incomplete)
        except OSError as e:   # fsafe.UnsafePath included: one message naming the path
            c.abandon()
            raise os_error(e, c.dir) from None
        except BaseException:
            c.abandon()
            raise
        return c

    def _take(self, name_check: Callable[[], None] | None, keep: Callable[[str], bool] | None,
              overwrite_incomplete: bool) -> None:
        mfd = self._open_model_dir()
        try:
            held = ExitStack()
            try:
                held.enter_context(lock.checkpoint_lock(self.root, self.model, self.cid.name, "save", wait=0))
            except ConflictError as e:
                raise ConflictError(f"cannot save {self.cid.name} now: {e}; this save wrote nothing — if it is another "
                                    "save of the same step, save under another epoch/step") from None
            self._lock = held
            self._refuse_if_committed(mfd)
            if name_check is not None:
                name_check()         # committed elsewhere (the archive)? refuses; see lifecycle/reuse.py
            self.dfd, self.created = open_subdir(mfd, self.cid.name, self.dir, create=True)
        finally:
            os.close(mfd)
        if not os.access(self.dir, os.W_OK):
            raise UserError(f"cannot write to {self.dir}: permission denied; fix its permissions or choose another --root")
        self._clear_stale(keep, overwrite_incomplete)

    def _open_model_dir(self) -> int:
        rfd = os.open(self.root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            try:
                fd, _ = open_subdir(rfd, self.model, self.mdir, create=True)
            except OSError as e:
                raise os_error(e, self.mdir) from None
            return fd
        finally:
            os.close(rfd)

    def _refuse_if_committed(self, mfd: int) -> None:
        try:
            st = os.lstat(self.cid.name, dir_fd=mfd)
        except FileNotFoundError:
            return
        fd, _ = open_subdir(mfd, self.cid.name, self.dir, create=False)   # raises for a symlink or a file
        try:
            m = valid_marker(fd, self.cid) if stat.S_ISDIR(st.st_mode) else None
        finally:
            os.close(fd)
        if m is not None:
            raise ConflictError(
                f"{self.dir} is already a committed checkpoint; committed checkpoints are never overwritten — "
                "save under another epoch/step, or delete it first (tiered-ckpt retention)"
            )

    def _clear_stale(self, keep: Callable[[str], bool] | None, overwrite_incomplete: bool) -> None:
        """Remove what earlier, never-committed saves of this name left (under the claim).

        A directory inside is never removed (no save creates one: it may hold anyone's files)."""
        assert self.dfd is not None
        stale: list[str] = []
        with os.scandir(self.dfd) as it:
            for e in it:
                if keep is not None and keep(e.name):
                    continue
                if e.is_dir(follow_symlinks=False):
                    raise UserError(
                        f"cannot write {self.dir}: it holds a directory {e.name!r} that no save creates; it is never "
                        "removed automatically (it may not be ours) — remove it or save under another epoch/step; "
                        "the checkpoint was not committed", exit_code=EXIT_CONFLICT)
                stale.append(e.name)
        if stale and not overwrite_incomplete:
            raise ConflictError(
                f"{self.dir} holds an earlier save of {self.cid.name} that never committed (no valid {MARKER}); "
                "pass overwrite_incomplete=True to replace it, or remove the directory"
            )
        for name in stale:
            try:
                os.unlink(name, dir_fd=self.dfd)   # unlink never follows a symlink
            except FileNotFoundError:
                pass
        if stale:
            os.fsync(self.dfd)

    # -- ending ----------------------------------------------------------------------------------
    def commit(self, manifest: Manifest) -> Path:
        """The marker, last: the directory entries this save created are made durable first (a power
        loss must not keep the marker and lose the directory holding it). From the first attempt on,
        nothing of this save is deleted any more (`committed`)."""
        assert self.dfd is not None
        fsync_parents(self.root, self.mdir)
        self.committed = True
        try:
            return commit.write_marker(self.dir, manifest, dir_fd=self.dfd)
        except OSError as e:
            raise os_error(e, self.dir / MARKER) from None

    def abandon(self) -> None:
        """A failed save: remove the directory if this save created it and it is empty, release."""
        if self.created and not self.committed and self.dfd is not None:
            try:
                with os.scandir(self.dfd) as it:
                    empty = next(it, None) is None
                if empty:
                    mfd = os.open(self.mdir, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC | os.O_NOFOLLOW)
                    try:
                        here = os.stat(self.cid.name, dir_fd=mfd, follow_symlinks=False)
                        mine = os.fstat(self.dfd)
                        if (here.st_dev, here.st_ino) == (mine.st_dev, mine.st_ino):
                            os.rmdir(self.cid.name, dir_fd=mfd)   # only if still empty
                            os.fsync(mfd)
                    finally:
                        os.close(mfd)
            except OSError:
                pass   # best effort: an empty directory without a marker is simply not committed
        self.release()

    def release(self) -> None:
        """Release the lock and close the directory (idempotent)."""
        held, self._lock = self._lock, None
        dfd, self.dfd = self.dfd, None
        try:
            if held is not None:
                held.close()
        finally:
            if dfd is not None:
                os.close(dfd)
