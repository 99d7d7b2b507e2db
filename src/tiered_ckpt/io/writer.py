"""One rank's save: claim and prepare the name, run the pipeline, agree, commit; run_async.

The shard layout is layout.py, the threads that write it pipeline.py, the end of a save (part
manifests, file-mode waits, failure notes, rank 0's marker) save_commit.py, and the POSIX
calls under all of them posix.py. Nothing is followed through a symlink (posix.py says how).

Who may reuse a name is io/claim.py's, the one claim-and-commit path every writer calls: rank
0 takes the claim (the name's lock, the local and the caller's `name_check` of the archive,
stale files of never-committed saves removed, the attempt's nonce drawn) before anything is
written and holds it until the marker is written or the save failed. Other ranks only ever
delete files carrying their own rank and save id, never one a valid marker lists.

Any exception on any rank in any phase (prepare, write, commit) fails every rank: under
torch.distributed through Comm.phase, without torch through failure notes in the directory.
"""
from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tiered_ckpt.distributed import Comm
from tiered_ckpt.errors import ConflictError, IntegrityError, UserError
from tiered_ckpt.io import commit, fsafe, nested, save_commit
from tiered_ckpt.io.claim import Claim
from tiered_ckpt.io.hashing import new_hasher
from tiered_ckpt.io.layout import FilePlan, file_owner, new_save_id, plan, require_save_id
from tiered_ckpt.io.marker import MARKER, FileEntry
from tiered_ckpt.io.options import WriteOptions
from tiered_ckpt.io.pipeline import Pipeline, Progress
from tiered_ckpt.io.pools import BlockPool
from tiered_ckpt.io.posix import open_subdir, os_error
from tiered_ckpt.io.sources import Source
from tiered_ckpt.naming import CheckpointId

log = logging.getLogger(__name__)


@dataclass
class SaveResult:
    name: str
    path: str
    bytes: int
    files: int
    rank: int
    world_size: int
    seconds: float
    direct: bool
    hashed: bool
    save_id: str = ""


class Save:
    """One save of one rank: prepare (caller's thread), produce, then finish and commit.

    Every phase ends in an agreement of all ranks (Comm.phase); a failure anywhere fails all.
    """

    def __init__(self, root: Path, model: str, cid: CheckpointId, sources: list[Source], comm: Comm,
                 opts: WriteOptions, pool: BlockPool, *, overwrite_incomplete: bool = True,
                 save_id: str | None = None, progress: Progress | None = None,
                 name_check: Callable[[], None] | None = None, structure: dict[str, Any] | None = None,
                 replicated: dict[str, Any] | None = None) -> None:
        self.structure = structure   # nested state's tree (io.nested), None for a flat mapping
        # Digests of the buffers declared replicated (save_commit.write_part; checked at commit).
        self.replicated = replicated
        self.root, self.model, self.cid, self.sources, self.comm, self.opts = Path(root), model, cid, sources, comm, opts
        self.pool, self.overwrite_incomplete, self.progress = pool, overwrite_incomplete, progress
        # Called by rank 0 under the claim, after the local marker check: raises ConflictError if the
        # name is committed elsewhere (the API passes lifecycle.reuse's; io knows nothing of tiers).
        self.name_check = name_check
        self.mdir = self.root / model
        self.dir = self.mdir / cid.name
        self.t0 = time.perf_counter()
        self.pipeline: Pipeline | None = None
        self.files: list[FilePlan] = []
        self.dfd: int | None = None
        self.entries: list[FileEntry] = []
        self._claim: Claim | None = None
        self.nonce: str | None = None     # the attempt's (rank 0's claim); every part carries it
        self._part: bytes | None = None   # file mode, rank > 0: this rank's published part manifest
        self._leave_files = False         # published: its files are rank 0's to list or to clear
        self._pending: BaseException | None = None   # a local failure the next agreement reports
        self._marker_attempted = False                # from here on nothing of this save is deleted
        self._noted = False
        self._closed = False
        # Start the writer threads when produce() runs, not at the prepare agreement: an async
        # save whose snapshot is staged produces in the background, off the caller's blocked time.
        self.start_in_produce = False
        self.file_mode = comm.world_size > 1 and not comm.uses_torch
        if save_id is not None:
            save_id = require_save_id(save_id)
        if self.file_mode and not save_id:
            raise UserError(
                f"rank {comm.rank} of {comm.world_size} without torch.distributed: pass save_id= a string every rank "
                "shares for this save (e.g. job id + attempt), so files of a crashed earlier attempt are never committed"
            )
        # Generated where none is given; under torch.distributed rank 0's id is adopted by all (prepare).
        self.save_id: str = save_id or new_save_id()

    # -- caller's thread -----------------------------------------------------------------
    def prepare(self) -> None:
        """Claim and check the name (rank 0), agree, then start the writer threads."""
        self.started(self.comm.phase("preparing", self.cid.name, self.prepare_local, self.on_failure))

    def started(self, ids: list[tuple[str, str] | None]) -> None:
        """After the prepare agreement: adopt rank 0's save id and nonce, open the directory, start the writers."""
        try:
            if self.comm.collective:
                got = ids[0]
                assert got is not None
                self.save_id, self.nonce = got
                if self.comm.rank != 0:
                    self.dfd = fsafe.open_dir(self.dir, anchor=self.root)
            self._start()
        except BaseException as e:  # noqa: BLE001 - reported to every rank at the next agreement
            self.fail(e)

    def prepare_local(self) -> tuple[str, str] | None:
        try:
            if self.comm.rank == 0:
                return self._prepare_rank0()
            commit.require_root(self.root)
            if self.file_mode:
                self._prepare_other_rank()
            return None
        except OSError as e:   # fsafe.UnsafePath included: one message naming the path
            raise os_error(e, self.dir) from None

    def _open_model_dir(self, create: bool) -> int:
        rfd = os.open(self.root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            try:
                fd, _ = open_subdir(rfd, self.model, self.mdir, create)
            except OSError as e:
                raise os_error(e, self.mdir) from None
            return fd
        finally:
            os.close(rfd)

    def _keep(self, name: str) -> bool:
        """File mode: another rank of this save id may already be writing it (its part will carry
        this attempt's nonce, or rank 0 never counts it). Under torch.distributed the other ranks
        start after the prepare agreement: everything there is stale."""
        owner = file_owner(name)
        return self.file_mode and owner is not None and owner[1] == self.save_id and owner[0] != self.comm.rank

    def _prepare_rank0(self) -> tuple[str, str]:
        c = self._claim = Claim.take(self.root, self.model, self.cid, name_check=self.name_check, keep=self._keep,
                                     overwrite_incomplete=self.overwrite_incomplete)
        assert c.dfd is not None
        self.dfd = os.dup(c.dfd)
        self.nonce = c.nonce
        if self.file_mode:
            save_commit.publish_claim(self.dfd, self.save_id, c.nonce)
        return self.save_id, c.nonce

    def _prepare_other_rank(self) -> None:
        """File mode, rank > 0: the directories (rank 0 may not be there yet), own stale files of this id."""
        mfd = self._open_model_dir(create=True)
        try:
            self.dfd, _ = open_subdir(mfd, self.cid.name, self.dir, create=True)
        finally:
            os.close(mfd)
        m = save_commit.valid_marker(self.dfd, self.cid)
        if m is not None:
            raise ConflictError(
                f"{self.dir} is already a committed checkpoint; committed checkpoints are never overwritten — "
                "save under another epoch/step"
            )
        self._cleanup_own(keep_note=False)   # a crashed attempt that used this same save id

    def _start(self) -> None:
        assert self.dfd is not None
        self.files = plan([s.nbytes for s in self.sources], self.opts.files, self.comm.rank, self.save_id)
        self.pipeline = Pipeline(self.dir, self.dfd, self.files, self.sources, self.pool, self.opts, self.progress)
        self.pipeline.rank = self.comm.rank
        if not self.start_in_produce:
            self.pipeline.start()

    def fail(self, exc: BaseException) -> None:
        """Record a local failure: the next agreement reports it to every rank."""
        if self._pending is None:
            self._pending = exc
        if self.pipeline is not None:
            self.pipeline.fail(exc)

    def produce(self) -> None:
        if self._pending is not None or self.pipeline is None:
            return
        try:
            if self.start_in_produce:
                self.pipeline.start()
            self.pipeline.produce()
        except BaseException as e:  # noqa: BLE001 - reported at the next agreement
            self.fail(e)

    # -- any thread ----------------------------------------------------------------------
    def finish(self) -> SaveResult:
        try:
            self.comm.phase("writing", self.cid.name, self._finish_local, self.on_failure)
            self.comm.phase("committing", self.cid.name, self._commit_local, self.on_failure)
        finally:
            self._close()
        return SaveResult(self.cid.name, str(self.dir), sum(s.nbytes for s in self.sources), len(self.entries),
                          self.comm.rank, self.comm.world_size, time.perf_counter() - self.t0,
                          self.pipeline.direct_used if self.pipeline is not None else False, self.opts.hash,
                          self.save_id)

    def abort(self, exc: BaseException) -> None:
        """Give up without an agreement (nothing else will run): clean up what this rank wrote."""
        self.on_failure(exc)
        self._close()

    def _finish_local(self) -> None:
        if self._pending is not None:
            raise self._pending
        assert self.pipeline is not None and self.dfd is not None
        try:
            entries = self.pipeline.finish()
            os.fsync(self.dfd)
            self.entries = entries
            if self.file_mode and self.comm.rank != 0:
                # Bound to rank 0's claim of this attempt: learn its nonce from the directory.
                self.nonce = save_commit.wait_for_claim(self.dfd, self.cid, self.save_id, self.opts.barrier_timeout)
            self._part = self._write_part(self.nonce or "")
        except OSError as e:
            raise os_error(e, self.dir) from None
        if self.file_mode and self.comm.rank == 0:
            assert self.nonce is not None
            save_commit.wait_for_parts(self.dfd, self.cid, self.save_id, self.nonce, self.comm.world_size,
                                       self.opts.barrier_timeout)

    def _commit_local(self) -> None:
        if self.comm.rank == 0:
            try:
                self._commit()
            except OSError as e:
                raise os_error(e, self.dir / MARKER) from None
            self._release()
        elif self.file_mode:
            assert self.dfd is not None and self._part is not None and self.nonce is not None
            save_commit.wait_for_marker(self.dfd, self.cid, self.save_id, self.comm.rank, self._part, self.nonce,
                                        lambda nonce: self._write_part(nonce, replace=True),
                                        self.opts.barrier_timeout)

    def on_failure(self, exc: BaseException) -> None:
        """On every failure path: stop the writers, tell file-mode ranks, remove this rank's files
        of this save (never once the marker may exist), release the claim."""
        try:
            if self.pipeline is not None:
                self.pipeline.fail(exc)
                try:
                    self.pipeline.finish()
                except BaseException:  # noqa: BLE001 - its error is exc or a consequence of it
                    pass
            if self.file_mode:
                self._note_failure(exc)
            if self._leave_files and self.dfd is not None and \
                    save_commit.rank0_failure(self.dfd, self.cid, self.save_id, self.nonce) is not None:
                self._leave_files = False     # rank 0 gave this attempt up: it will list nothing
            if not self._marker_attempted and not self._leave_files:
                self._cleanup_own(keep_note=True)
            if self._claim is not None:
                self._close_dir()
                if self.comm.world_size == 1:
                    self._claim.abandon()   # removes the directory only if this save created it and it is empty
                else:
                    # Other ranks may still be about to write into it: they must learn of this failure
                    # from the rank agreement, not from a vanished directory. Empty, it is not committed.
                    self._claim.release()
        finally:
            self._close()      # the save is over: release the claim, close the directory

    def _release(self) -> None:
        claim, self._claim = self._claim, None
        if claim is not None:
            claim.release()

    def _close_dir(self) -> None:
        if self.dfd is not None:
            os.close(self.dfd)
            self.dfd = None

    def _close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._release()
        self._close_dir()

    def _cleanup_own(self, keep_note: bool) -> None:
        if self.dfd is not None:
            save_commit.cleanup_own(self.dfd, self.comm.rank, self.save_id, keep_note)

    def _write_part(self, nonce: str, replace: bool = False) -> bytes:
        assert self.dfd is not None
        data = save_commit.part_bytes(self.cid, self.save_id, nonce, self.comm.rank, self.comm.world_size, self.files,
                                      self.sources, self.entries, self.structure, self.replicated)
        save_commit.write_part(self.dfd, self.comm.rank, self.save_id, data, replace=replace)
        # From here rank 0 may list these files: file mode leaves them to it, unless it noted a failure.
        self._leave_files = self.file_mode and self.comm.rank != 0
        self._part = data
        return data

    def _note_failure(self, exc: BaseException) -> None:
        """File mode: tell the other ranks (they poll for it) that this rank failed."""
        if self._noted:
            return
        self._noted = True
        save_commit.note_failure(self.root, self.model, self.cid, self.comm.rank, self.comm.world_size, self.save_id,
                                 exc, self.dfd, nonce=self.nonce)

    # -- rank 0 --------------------------------------------------------------------------
    def _commit(self) -> None:
        assert self.dfd is not None and self._claim is not None and self.nonce is not None
        m = save_commit.marker_of(self.dfd, self.root, self.dir, self.cid, self.save_id, self.nonce,
                                  self.comm.world_size)
        self._marker_attempted = True
        self._claim.commit(m)


def digest(s: Source, chunk: int = 16 << 20) -> str:
    """Hex xxh3-128 of a source's bytes (in memory directly; device memory or a stream chunk by chunk)."""
    h = new_hasher()
    if s.view is not None:
        h.update(s.view)
        return h.hexdigest()
    buf = memoryview(bytearray(min(chunk, max(1, s.nbytes))))
    for off in range(0, s.nbytes, len(buf)):
        piece = buf[:min(len(buf), s.nbytes - off)]
        s.copy_into(off, piece)
        h.update(piece)
    return h.hexdigest()


def split_replicated(sources: list[Source], structure: dict[str, Any], keys: list[str], rank: int,
                     world_size: int) -> tuple[list[Source], dict[str, Any], dict[str, Any]]:
    """(sources this rank writes, its tree with rbuf nodes, the digests of every replicated buffer).

    The buffers under the replicated top-level `keys` are spread over the ranks (nested.assign);
    each rank writes its share and names the rest by owner. Every replicated buffer is hashed
    here, on every rank (memory speed): rank 0 compares the digests at commit, so data that
    differs between ranks is refused, never silently replaced by another rank's.
    """
    names = set(nested.under_keys(structure, keys))
    by_name = {s.name: s for s in sources}
    owners = nested.assign([(n, by_name[n].nbytes) for n in sorted(names)], world_size)
    record = {n: {"digest": digest(by_name[n]), "kind": by_name[n].kind, "dtype": by_name[n].dtype,
                  "shape": by_name[n].shape, "nbytes": by_name[n].nbytes} for n in sorted(names)}
    mine = [s for s in sources if owners.get(s.name, rank) == rank]
    return mine, nested.to_remote(structure, owners, rank), record


def run_async(save: Save, zero_copy: bool) -> Future[SaveResult]:
    """Produce (snapshot) in the caller's thread unless zero-copy, then finish in the background."""
    fut: Future[SaveResult] = Future()
    fut.set_running_or_notify_cancel()

    def finish() -> None:
        try:
            if zero_copy:
                save.produce()
            fut.set_result(save.finish())
        except BaseException as e:
            fut.set_exception(e)

    if not zero_copy:
        save.produce()
        err = save._pending or (save.pipeline.error if save.pipeline is not None else None)
        if isinstance(err, IntegrityError):
            # A buffer changed while it was being snapshotted (or the snapshot failed): tell the
            # caller now. Alone, finish here (it fails and cleans up); with other ranks, the
            # background finish still takes part in the agreements, so none of them waits.
            if not save.comm.collective:
                save.finish()
                raise err
            threading.Thread(target=finish, name=f"ckpt-commit-{save.cid.name}", daemon=True).start()
            raise err
    threading.Thread(target=finish, name=f"ckpt-commit-{save.cid.name}", daemon=True).start()
    return fut
