"""torch.distributed.checkpoint (DCP) storage for the toolkit's commit protocol.

    import torch.distributed.checkpoint as dcp
    from tiered_ckpt.dcp import TieredReader, TieredWriter
    dcp.save(state, storage_writer=TieredWriter(root, model, epoch=3, step=12000))
    dcp.load(state, storage_reader=TieredReader(root, model, epoch=3, step=12000))

DCP's own FileSystemWriter commits by writing ``.metadata.tmp`` and renaming it; AMLFS
auto-export never propagates a rename, so the archive would never see the metadata. Here
nothing is renamed: every rank writes its items (tensor bytes raw, non-tensor objects as the
bytes DCP serialized) into a few shard files under their final names
(``shard-r00000-000.<id>.bin``: rank, file, and an id the rank draws for this save), through
the toolkit's write pipeline (io/pipeline.py: page-aligned pool blocks, O_DIRECT, one writer
thread per file, xxh3-128 inline, fsync; small items share blocks instead of costing a system
call each). The coordinator then writes DCP's pickled Metadata as ``dcp.<sid>.metadata`` (its
save id; final name, fsynced; not a dot-name, which the exporter skips) and last
``COMMITTED.json`` listing every file with its size and hash. The coordinator holds the
checkpoint name's lock from planning to the marker and refuses a name that is already
committed; a save that fails releases it (at once when the coordinator's own write failed,
else when the writer is reset, closed or no longer referenced — the next claim of the name in
this process collects such writers first).

Plan caching: pass DCP's planner with caching on, the same for every save of a run,

    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
    dcp.save(state, storage_writer=TieredWriter(...), planner=DefaultSavePlanner(enable_plan_caching=True))

and from the second save on (same tensors, shapes and dtypes) no rank re-plans and the
coordinator skips the global plan: each rank writes from its cached plan. Every save still
claims its name and gets its own save id (prepare_global_plan runs on every save; nothing of a
save depends on the plan's storage_data, which caching keeps from the first save).

Async: `dcp.async_save(state, storage_writer=TieredWriter(...), async_stager=TieredStager(...))`
(tiered_ckpt.dcp_stage) stages into a bounded, reusable pool; in process mode DCP pickles the
writer into its background process, which takes the claim there (a pickled writer carries no
claim and no descriptor).

Resharding (load at another world size, DTensor placements) is DCP's planner's job; the reader
only serves the byte ranges it asks for, after checking the marker: per file in file order,
adjacent ranges in one preadv, whole tensors straight into the destination. Torch is imported
here (and in dcp_stage) only: the rest of the toolkit works without it.
"""
from __future__ import annotations

import functools
import gc
import heapq
import io
import logging
import math
import os
import pickle
import threading
import time
import weakref
from contextlib import ExitStack
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
from torch.distributed._shard._utils import narrow_tensor_by_index
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, StorageMeta
from torch.distributed.checkpoint.planner import (
    LoadItemType,
    LoadPlan,
    LoadPlanner,
    SavePlan,
    SavePlanner,
    WriteItemType,
)
from torch.distributed.checkpoint.storage import StorageReader, StorageWriter, WriteResult
from torch.futures import Future

from tiered_ckpt import dcp_pickle, dcp_stage, records
from tiered_ckpt.config import IoConfig, NodeConfig
from tiered_ckpt.errors import ConflictError, IntegrityError, UserError
from tiered_ckpt.io import commit as mf
from tiered_ckpt.io import fill, fsafe, lock, pools
from tiered_ckpt.io.fill import Pieces
from tiered_ckpt.io.hashing import hash_path, new_hasher
from tiered_ckpt.io.layout import SHARD, FilePlan, Segment, new_save_id
from tiered_ckpt.io.options import IoOptions, WriteOptions
from tiered_ckpt.io.pipeline import Pipeline
from tiered_ckpt.io.posix import fsync_parents, open_subdir, os_error, write_small
from tiered_ckpt.io.sources import Source, byte_view, to_source
from tiered_ckpt.logs import fields
from tiered_ckpt.naming import DEFAULT as DEFAULT_NAMING
from tiered_ckpt.naming import CheckpointId, make_id, require_name, scheme

log = logging.getLogger(__name__)

__all__ = ["METADATA", "TieredReader", "TieredWriter", "is_dcp_checkpoint", "metadata_name"]

METADATA = "dcp.{sid}.metadata"
# A WriteResult that carries a rank's file entries to the coordinator; never part of the metadata.
_FILES_FQN = "__tiered_ckpt_files__"


def metadata_name(save_id: str) -> str:
    return METADATA.format(sid=save_id)


def is_dcp_checkpoint(manifest: mf.Manifest) -> bool:
    """Whether a committed checkpoint was written by TieredWriter (its marker lists DCP metadata)."""
    return manifest.save_id is not None and any(f.path == metadata_name(manifest.save_id) for f in manifest.files)


@dataclass(frozen=True)
class _Stored:
    """Where one write item's bytes are (pickled into DCP's metadata.storage_data)."""

    relative_path: str
    offset: int
    length: int
    dtype: str | None = None                 # tensors: raw bytes of this dtype and shape
    shape: tuple[int, ...] | None = None
    # BYTE_IO items: xxh3-128 of the item's bytes, checked before DCP's planner unpickles them
    # (dcp_pickle); None in checkpoints saved before it was recorded (then the whole file is hashed).
    hash: str | None = None


@dataclass(frozen=True)
class _Prefix:
    """The coordinator's global plan for one rank: the save id every file name carries."""

    save_id: str
    rank: int


def _resolve(root: str | os.PathLike[str] | None, model: str | None, config: NodeConfig | None) -> tuple[Path, str]:
    if config is not None:
        root = root if root is not None else config.root
        model = model if model is not None else config.model
    if root is None or model is None:
        raise UserError("TieredWriter/TieredReader need the checkpoint root and the model: pass root= and model=, "
                        "or config=tiered_ckpt.config.NodeConfig(root=..., model=...)")
    return Path(root), model


def _cid(name: str | None, epoch: int | None, step: int | None, naming: str = DEFAULT_NAMING) -> CheckpointId:
    """The checkpoint's id in the model's `naming:` scheme (step alone for the step-only schemes)."""
    if name is not None:
        return require_name(name, naming)
    if step is None or (epoch is None and scheme(naming).has_epoch):
        raise UserError("pass name='global_epoch{E}_step{S}' or epoch= and step= (which checkpoint to save or load)")
    return make_id(epoch or 0, step, naming)


class _Hold:
    """The coordinator's claim of the name and its directory descriptor, released once.

    Kept apart from the writer so that a `weakref.finalize` of the writer can release it: a
    save that failed on another rank never calls back into this writer (DCP skips `finish`),
    so the claim is released by reset()/close(), or when the writer object is gone.
    """

    def __init__(self, claim: ExitStack, dfd: int, key: str) -> None:
        self.claim: ExitStack | None = claim
        self.dfd: int | None = dfd
        self.key = key

    def close(self) -> None:
        claim, self.claim = self.claim, None
        dfd, self.dfd = self.dfd, None
        with _held_lock:
            if _held.get(self.key) is self:
                del _held[self.key]
        try:
            if claim is not None:
                claim.close()
        finally:
            if dfd is not None:
                os.close(dfd)


# Lock files of checkpoint names this process's writers hold (flock conflicts within a process too).
_held: dict[str, _Hold] = {}
_held_lock = threading.Lock()


class TieredWriter(StorageWriter):
    """A DCP StorageWriter: rename-free, fsynced, committed by the toolkit's marker (module doc).

    options: the I/O knobs (files per rank, writer threads, block size, O_DIRECT, hashing,
    sync_buffer_bytes); fields left at None take `config.io` (or the IoConfig defaults).
    """

    def __init__(self, root: str | os.PathLike[str] | None = None, model: str | None = None, *,
                 name: str | None = None, epoch: int | None = None, step: int | None = None,
                 config: NodeConfig | None = None, options: IoOptions | None = None) -> None:
        super().__init__()
        self.root, self.model = _resolve(root, model, config)
        self.naming = config.naming if config is not None else DEFAULT_NAMING
        self.cid = _cid(name, epoch, step, self.naming)
        iocfg = config.io if config is not None else IoConfig()
        options = options if options is not None else IoOptions()
        self.opts: WriteOptions = options.resolve(iocfg)
        self.buffer_bytes = options.pool_bytes("sync", iocfg)
        self.is_coordinator = False
        self.rank: int | None = None
        self._hold: _Hold | None = None
        self._finalizer: weakref.finalize[Any, Any] | None = None
        self.save_id: str | None = None

    @property
    def path(self) -> Path:
        return self.root / self.model / self.cid.name

    @property
    def _dfd(self) -> int | None:
        return self._hold.dfd if self._hold is not None else None

    # A process-mode async_save pickles the writer into DCP's background process: the claim and
    # descriptors stay with this object (the background process takes its own claim).
    def __getstate__(self) -> dict[str, Any]:
        d = self.__dict__.copy()
        d["_hold"] = d["_finalizer"] = None
        return d

    def __setstate__(self, d: dict[str, Any]) -> None:
        self.__dict__.update(d)

    # -- StorageWriter -------------------------------------------------------------------
    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        self.close()      # a save that failed elsewhere never reached finish(): drop its claim
        if checkpoint_id:
            p = Path(checkpoint_id)
            self.root, self.model, self.cid = p.parent.parent, p.parent.name, require_name(p.name, self.naming)
        self.save_id = None

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self.is_coordinator = is_coordinator
        rank = kwargs.get("rank")
        self.rank = rank if isinstance(rank, int) else None

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        """Coordinator: claim the name, refuse a committed one, clear a crashed save's files, pick the save id.

        DCP calls this on every save, also when the planner's cache (enable_plan_caching) skips
        re-planning: then `plans` are "unusable" deltas and every rank writes from its cached
        plan, whose storage_data is the first save's. Nothing of a save may therefore depend
        on storage_data being fresh: each rank names its files with its own new id (_write),
        and the save id (metadata and marker) is the coordinator's, picked here.
        """
        self.close()
        self._t0 = time.monotonic()
        sid = new_save_id()
        mf.require_root(self.root)
        self._claim_name()
        self.save_id = sid
        return [replace(p, storage_data=_Prefix(sid, i)) for i, p in enumerate(plans)]

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        prefix = plan.storage_data
        rank = self.rank if self.rank is not None else prefix.rank if isinstance(prefix, _Prefix) else 0
        fut: Future[list[WriteResult]] = Future()
        read: list[int] = []
        try:
            fut.set_result(self._write(plan, planner, rank, read))
        except BaseException as e:  # noqa: BLE001 - DCP gathers it and fails every rank
            if self.is_coordinator:
                self.close()    # DCP never calls finish after a failed write: release the name now
            err = os_error(e, self.path) if isinstance(e, OSError) else e
            fut.set_exception(err)  # type: ignore[arg-type]  # torch types it as T
        finally:
            # A TieredStager holding this save's staging memory may free it (and a caller waiting
            # for its tensors to be written may go on): this rank is done reading them.
            dcp_stage.notify_written(read + dcp_stage.addresses(getattr(planner, "state_dict", None)))
        return fut

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        """Coordinator: DCP's metadata under its final name, then the marker (written last)."""
        try:
            assert self.save_id is not None and self._dfd is not None
            entries: list[mf.FileEntry] = []
            storage: dict[MetadataIndex, Any] = {}
            for rank_results in results:
                for wr in rank_results:
                    if wr.index.fqn == _FILES_FQN:
                        entries.extend(wr.storage_data)
                    else:
                        storage[wr.index] = wr.storage_data
            # A copy: with plan caching DCP hands every save the same Metadata object.
            data = pickle.dumps(replace(metadata, storage_data=storage))
            name = metadata_name(self.save_id)
            try:
                write_small(self._dfd, name, data)
            except OSError as e:
                raise os_error(e, self.path / name) from None
            h = new_hasher()
            h.update(data)
            entries.append(mf.FileEntry(name, len(data), h.hexdigest(), 0))
            m = mf.Manifest(epoch=self.cid.epoch, step=self.cid.step, files=entries, world_size=len(results),
                            index={}, save_id=self.save_id)
            try:
                # The directory entries are durable before the marker names them.
                fsync_parents(self.root, self.root / self.model)
                mf.write_marker(self.path, m, dir_fd=self._dfd)
            except OSError as e:
                raise os_error(e, self.path / mf.MARKER) from None
        except BaseException as e:
            log.error("DCP save of %s failed at commit: %s", self.cid.name, e,
                      extra=fields("dcp save", model=self.model, checkpoint=self.cid.name, outcome="error"))
            raise
        finally:
            self.close()
        seconds = time.monotonic() - getattr(self, "_t0", time.monotonic())
        total = sum(e.size for e in entries)
        # The same record tc.save leaves (records.py): save metrics, and the timeline's write start
        # (time of the record minus `seconds`). Best effort: never fails the committed save.
        records.record(self.root, self.model, records.SAVE,
                       {"name": self.cid.name, "bytes": total, "seconds": seconds, "files": len(entries),
                        "world_size": len(results), "via": "dcp"},
                       totals={"saves": 1, "bytes": total})
        log.info("DCP save committed %s: %d bytes, %d rank(s), %.2fs since planning", self.cid.name, total,
                 len(results), seconds,
                 extra=fields("dcp save", model=self.model, checkpoint=self.cid.name, duration_s=seconds,
                              nbytes=total, world_size=len(results), files=len(entries)))

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return False      # never picked automatically: the caller passes storage_writer= explicitly

    def storage_meta(self) -> StorageMeta | None:
        return StorageMeta(checkpoint_id=str(self.path), save_id=self.save_id or "")

    # -- ours ----------------------------------------------------------------------------
    def close(self) -> None:
        """Release the name's claim and the directory (after finish, or a save that failed)."""
        hold, self._hold = self._hold, None
        fin, self._finalizer = self._finalizer, None
        if fin is not None:
            fin.detach()
        if hold is not None:
            hold.close()

    def _claim_name(self) -> None:
        key = str(lock.checkpoint_lock_path(self.root, self.model, self.cid.name))
        try:
            self._claim_once(key)
        except ConflictError:
            with _held_lock:
                ours = key in _held
            if not ours:
                raise
            # This process holds it: a writer of an earlier, failed save that nothing references any
            # more (its finalizer releases the claim once collected). One still in use keeps it.
            gc.collect()
            self._claim_once(key)

    def _claim_once(self, key: str) -> None:
        mdir = self.root / self.model
        rfd = os.open(self.root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            try:
                mfd, _ = open_subdir(rfd, self.model, mdir, create=True)
            except OSError as e:
                raise os_error(e, mdir) from None
        finally:
            os.close(rfd)
        claim = ExitStack()
        try:
            try:
                claim.enter_context(lock.checkpoint_lock(self.root, self.model, self.cid.name, "save", wait=0))
            except ConflictError as e:
                raise ConflictError(f"cannot save {self.cid.name} now: {e}; this save wrote nothing") from None
            info = mf.inspect(self.model, self.path, self.cid, anchor=self.root)
            if info.committed:
                raise ConflictError(f"{self.path} is already a committed checkpoint; committed checkpoints are never "
                                    "overwritten — save under another epoch/step, or delete it first (tiered-ckpt retention)")
            try:
                dfd, _ = open_subdir(mfd, self.cid.name, self.path, create=True)
            except OSError as e:
                raise os_error(e, self.path) from None
            try:
                self._clear_stale(dfd)
            except BaseException:
                os.close(dfd)
                raise
        except BaseException:
            claim.close()
            raise
        finally:
            os.close(mfd)
        hold = _Hold(claim, dfd, key)
        with _held_lock:
            _held[key] = hold
        self._hold = hold
        self._finalizer = weakref.finalize(self, hold.close)

    def _clear_stale(self, dfd: int) -> None:
        """Files of earlier saves of this name that never committed (no other rank writes yet)."""
        stale = []
        with os.scandir(dfd) as it:
            for e in it:
                if e.is_dir(follow_symlinks=False):
                    raise UserError(f"cannot write {self.path}: it holds a directory {e.name!r} that no save creates; "
                                    "remove it or save under another epoch/step; the checkpoint was not committed")
                stale.append(e.name)
        for n in stale:
            try:
                os.unlink(n, dir_fd=dfd)      # never follows a symlink
            except FileNotFoundError:
                pass
        if stale:
            os.fsync(dfd)

    def _write(self, plan: SavePlan, planner: SavePlanner, rank: int, read: list[int]) -> list[WriteResult]:
        """This rank's items through the toolkit's write pipeline (pipeline.py): copy threads fill
        page-aligned pool blocks, one writer thread per file writes them with O_DIRECT and hashes
        them inline (xxh3-128), every file fsynced. Small items share blocks, so they cost a
        memmove each, not a system call."""
        if not plan.items:
            return []
        # Its own id: the plan's storage_data may be a cached plan's (prepare_global_plan says why).
        sid = new_save_id()
        sources: list[Source] = []
        metas: list[tuple[Any, str | None, tuple[int, ...] | None, str | None]] = []
        for item in plan.items:
            data = planner.resolve_data(item)
            if item.type == WriteItemType.BYTE_IO:
                assert isinstance(data, io.BytesIO)
                buf = data.getbuffer()
                h = new_hasher()
                h.update(buf)
                sources.append(to_source(item.index.fqn or "-", buf))
                metas.append((item.index, None, None, h.hexdigest()))
            else:
                assert isinstance(data, torch.Tensor)
                read.append(data.data_ptr())
                t = data.detach()
                if not t.is_contiguous():
                    t = t.contiguous()
                sources.append(to_source(item.index.fqn or "-", t))
                metas.append((item.index, str(t.dtype).removeprefix("torch."), tuple(t.shape), None))
        files, where = _layout(sources, rank, sid, self.opts)
        dfd = self._dfd if self._dfd is not None else fsafe.open_dir(self.path, anchor=self.root)
        try:
            pool = pools.pool("sync", self.buffer_bytes, self.opts.block_size)
            pipe = Pipeline(self.path, dfd, files, sources, pool, self.opts, None)
            pipe.rank = rank
            pipe.start()
            try:
                pipe.produce()
            finally:
                entries = pipe.finish()   # joins the writers; raises the first failure
            os.fsync(dfd)
        finally:
            if dfd != self._dfd:
                os.close(dfd)
        results: list[WriteResult] = []
        for (index, dtype, shape, digest), src, (fname, off) in zip(metas, sources, where, strict=True):
            info = _Stored(fname, off, src.nbytes, dtype, shape, digest)
            results.append(WriteResult(index=index, size_in_bytes=src.nbytes, storage_data=info))
        results.append(WriteResult(index=MetadataIndex(_FILES_FQN), size_in_bytes=0, storage_data=entries))
        return results


# Bytes per file below which a rank's items share fewer files: a writer thread per file pays
# off only when each has several blocks to write.
_BLOCKS_PER_FILE = 4


def _layout(sources: list[Source], rank: int, sid: str, opts: WriteOptions) -> tuple[list[FilePlan], list[tuple[str, int]]]:
    """Whole items into at most opts.files shard files of about equal size (largest first onto
    the least-filled file), each item at one offset of one file: DCP's reader asks per item."""
    total = sum(s.nbytes for s in sources)
    nfiles = max(1, min(opts.files, total // (_BLOCKS_PER_FILE * opts.block_size)))
    files = [FilePlan(SHARD.format(rank=rank, i=i, sid=sid), 0) for i in range(nfiles)]
    where: list[tuple[str, int]] = [("", 0)] * len(sources)
    order = sorted(range(len(sources)), key=lambda i: -sources[i].nbytes)
    fill_heap = [(0, j) for j in range(nfiles)]     # (bytes so far, file): the least filled on top
    for i in order:
        n = sources[i].nbytes
        if not n:
            where[i] = (files[0].path, 0)    # the largest item is there: that file exists
            continue
        _, j = fill_heap[0]
        f = files[j]
        where[i] = (f.path, f.size)
        f.segments.append(Segment(i, 0, f.size, n))
        f.size += n
        heapq.heapreplace(fill_heap, (f.size, j))
    return [f for f in files if f.size or f is files[0]], where


class TieredReader(StorageReader):
    """A DCP StorageReader of a committed checkpoint: refuses one without a valid marker.

    The marker and the sizes of every file are checked when it is made (on every rank, before
    `dcp.load`). Whatever is unpickled is hashed first, always, by the rank that unpickles it:
    DCP's metadata against the marker (then unpickled with an allow-list, dcp_pickle) and each
    non-tensor item against the hash the metadata records for it. With `verify_hash=True` every
    data file's xxh3-128 too (shared among the ranks: a mismatch on one fails the load on all).
    """

    def __init__(self, root: str | os.PathLike[str] | None = None, model: str | None = None, *,
                 name: str | None = None, epoch: int | None = None, step: int | None = None,
                 config: NodeConfig | None = None, verify_hash: bool = False) -> None:
        super().__init__()
        self.root, self.model = _resolve(root, model, config)
        self.naming = config.naming if config is not None else DEFAULT_NAMING
        self.cid = _cid(name, epoch, step, self.naming)
        self.verify_hash = verify_hash
        self.io = config.io if config is not None else IoConfig()    # reader threads, block size, O_DIRECT
        self.storage_data: dict[MetadataIndex, _Stored] = {}
        self._metadata: Metadata | None = None
        self._hashed: set[str] = set()          # files hashed whole by this reader (old BYTE_IO items)
        self.manifest = self._check()

    @property
    def path(self) -> Path:
        return self.root / self.model / self.cid.name

    def _check(self) -> mf.Manifest:
        m, why = mf.read_marker_checked(self.path, anchor=self.root)
        if m is None:
            raise IntegrityError(f"{self.path} is not a committed checkpoint ({why or 'no ' + mf.MARKER}); "
                                 "a save that did not finish is never loaded: load another checkpoint (tiered-ckpt list)")
        problems = mf.size_problems(self.path, m, anchor=self.root)
        if problems:
            raise IntegrityError(f"{self.path} does not match its marker: {problems[0]}"
                                 + (f" (and {len(problems) - 1} more)" if len(problems) > 1 else "")
                                 + "; restore it from the archive (tiered-ckpt restore) or load another checkpoint")
        if not is_dcp_checkpoint(m):
            raise UserError(f"{self.path} was not saved through torch.distributed.checkpoint (no DCP metadata in its "
                            "marker); load it with tiered_ckpt.load instead")
        return m

    # -- StorageReader -------------------------------------------------------------------
    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        self.storage_data = {}
        if checkpoint_id:
            p = Path(checkpoint_id)
            self.root, self.model, self.cid = p.parent.parent, p.parent.name, require_name(p.name, self.naming)
            self.manifest = self._check()
            self._metadata = None
            self._hashed = set()

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        m = self.manifest
        if self.verify_hash:
            self._verify_hashes(m)
        return self.metadata()

    def metadata(self) -> Metadata:
        """DCP's metadata of this checkpoint, read once, its bytes checked against the marker's
        hash before they are unpickled (with an allow-list: dcp_pickle)."""
        if self._metadata is not None:
            return self._metadata
        m = self.manifest
        assert m.save_id is not None
        name = metadata_name(m.save_id)
        entry = m.by_path[name]
        path = self.path / name
        try:
            data = fsafe.read_file(path, anchor=self.root, limit=entry.size)
        except OSError as e:
            raise IntegrityError(f"{path}: cannot read DCP metadata ({e.strerror or e}); "
                                 "restore the checkpoint from the archive (tiered-ckpt restore)") from None
        if len(data) != entry.size:
            raise IntegrityError(f"{path}: DCP metadata is {len(data)} bytes, the marker lists {entry.size}; "
                                 "restore the checkpoint from the archive (tiered-ckpt restore)")
        dcp_pickle.check_hash(data, entry.hash, path, "DCP metadata")
        md = dcp_pickle.restricted_loads(data, path)
        if not isinstance(md, Metadata):
            raise IntegrityError(f"{path} is not DCP metadata; restore the checkpoint from the archive")
        if getattr(md, "storage_meta", None) is None:
            md.storage_meta = StorageMeta()
        self._metadata = md
        return md

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self.storage_data = metadata.storage_data

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        fut: Future[None] = Future()
        try:
            self._read(plan, planner)
            fut.set_result(None)
        except BaseException as e:  # noqa: BLE001 - DCP gathers it and fails every rank
            fut.set_exception(e)  # type: ignore[arg-type]  # torch types it as T
        return fut

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return False

    # -- ours ----------------------------------------------------------------------------
    def _verify_hashes(self, m: mf.Manifest) -> None:
        import torch.distributed as dist

        rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_available() and dist.is_initialized() else (0, 1)
        meta = metadata_name(m.save_id) if m.save_id is not None else None
        for i, f in enumerate(m.files):
            if i % world != rank or f.hash is None or f.path == meta:   # metadata: every rank, metadata()
                continue
            got = hash_path(str(self.path / f.path), anchor=self.root)
            if got != f.hash:
                raise IntegrityError(f"{self.path / f.path}: content hash {got} does not match the marker's {f.hash}; "
                                     "restore the checkpoint from the archive (tiered-ckpt restore)")

    def _check_item(self, info: _Stored, view: memoryview, fqn: str) -> None:
        """A non-tensor item's bytes against the hash the (verified) metadata records; a checkpoint
        saved before items were hashed: its whole file against the marker, once per reader."""
        digest = getattr(info, "hash", None)
        if digest is not None:
            dcp_pickle.check_hash(view, digest, self.path / info.relative_path, f"item {fqn!r}")
            return
        if info.relative_path in self._hashed:
            return
        entry = self.manifest.by_path[info.relative_path]
        got = hash_path(str(self.path / info.relative_path), anchor=self.root)
        if entry.hash is None or got != entry.hash:
            raise IntegrityError(f"{self.path / info.relative_path}: content hash {got} does not match the marker's "
                                 f"{entry.hash} (it holds item {fqn!r}, which was not unpickled); restore the "
                                 "checkpoint from the archive (tiered-ckpt restore)")
        self._hashed.add(info.relative_path)

    def _read(self, plan: LoadPlan, planner: LoadPlanner) -> None:
        """Every requested byte range read by several threads straight into its destination
        (io/fill.py: O_DIRECT wherever the file's pages allow, whatever the destination's address;
        small items coalesced). A request for a whole saved tensor, or for a part of one that is
        one byte range (a resharded load's rows), lands in the destination tensor itself when its
        dtype, shape and layout allow (no intermediate buffer, no copy); otherwise only the bytes
        asked for are read into a page-aligned buffer and copied. Then every item goes to the planner."""
        sizes = {f.path: f.size for f in self.manifest.files}
        pieces: dict[str, Pieces] = {}
        items: list[tuple[Any, _Stored, Any, memoryview, bool]] = []
        path = self.path           # a property: computed once, not per item
        for req in plan.items:
            info = self.storage_data.get(req.storage_index)
            if not isinstance(info, _Stored):
                raise IntegrityError(f"{path}: DCP metadata has no valid location for {req.storage_index.fqn!r}; "
                                     "restore the checkpoint from the archive (tiered-ckpt restore)")
            _check_stored(path, info, sizes)
            off, n, part = _byte_range(path, req, info)
            dest, view = _destination(req, info, planner, off, n, part)
            pieces.setdefault(info.relative_path, []).append((off, n, view))
            items.append((req, info, dest, view, part))
        files = [f for f in self.manifest.files if f.path in pieces]
        bufs = pools.pool("read", self.io.threads * self.io.block_size, self.io.block_size)

        def stream(e: mf.FileEntry, view: memoryview) -> str | None:   # every file here has pieces
            return f"{self.path / e.path}: nothing to read"

        problems = fill.fill(self.path, files, pieces, pool=bufs, threads=self.io.threads, direct=self.io.direct,
                             check_hash=False, stream=stream, progress=None, anchor=self.root)
        if problems:
            raise IntegrityError("; ".join(problems) + "; restore the checkpoint from the archive (tiered-ckpt restore)")
        for req, info, dest, view, part in items:
            if req.type == LoadItemType.BYTE_IO:
                # DCP's planner torch.load()s these bytes (weights_only=False): hashed first.
                self._check_item(info, view, req.storage_index.fqn)
                planner.load_bytes(req, io.BytesIO(view.tobytes()))
                continue
            if dest is not None:
                planner.commit_tensor(req, dest)
                continue
            dtype = _dtype(info.dtype) if info.dtype is not None else None
            assert dtype is not None and info.shape is not None
            t = torch.frombuffer(view, dtype=dtype) if len(view) else torch.empty(0, dtype=dtype)
            if part:
                t = t.reshape(tuple(req.lengths))
            else:
                t = narrow_tensor_by_index(t.reshape(info.shape), req.storage_offsets, req.lengths)
            target = planner.resolve_tensor(req).detach()
            if target.size() != t.size():
                raise IntegrityError(f"{self.path / info.relative_path}: item {req.storage_index.fqn} has shape "
                                     f"{tuple(t.size())}, the state to load expects {tuple(target.size())}")
            target.copy_(t)
            planner.commit_tensor(req, target)


def _byte_range(path: Path, req: Any, info: _Stored) -> tuple[int, int, bool]:
    """(file offset, bytes, whether that is only the part asked for) to read for one request.

    A part of a saved tensor (storage_offsets/lengths: resharding) is one byte range of its
    row-major bytes when every dimension before some k is asked for one index and every one
    after k in full; then only it is read. Otherwise the whole item is."""
    if req.type == LoadItemType.BYTE_IO or info.shape is None or info.dtype is None:
        return info.offset, info.length, False
    shape, offs, lens = tuple(info.shape), tuple(req.storage_offsets), tuple(req.lengths)
    if lens == shape and not any(offs):          # the whole item: the common case, checked cheaply
        return info.offset, info.length, False
    if len(offs) != len(shape) or len(lens) != len(shape) or any(
            not (0 <= o and 0 <= n and o + n <= d) for o, n, d in zip(offs, lens, shape, strict=True)):
        raise IntegrityError(f"{path / info.relative_path}: DCP asks for {_box(offs, lens)} of item "
                             f"{req.storage_index.fqn}, which has shape {shape}; the checkpoint's metadata is "
                             "damaged — restore it from the archive (tiered-ckpt restore)")
    k = 0
    while k < len(shape) and lens[k] == 1:
        k += 1
    if any(lens[i] != shape[i] for i in range(k + 1, len(shape))):
        return info.offset, info.length, False
    dt = _dtype(info.dtype)
    assert dt is not None               # _check_stored ran
    itemsize = dt.itemsize
    start, stride = 0, itemsize
    for i in range(len(shape) - 1, -1, -1):
        start += offs[i] * stride
        stride *= shape[i]
    n = itemsize
    for d in lens:
        n *= d
    return info.offset + start, n, True


def _box(offs: tuple[int, ...], lens: tuple[int, ...]) -> str:
    """A request's index ranges, as [start:end, ...]."""
    return "[" + ", ".join(f"{o}:{o + n}" for o, n in zip(offs, lens, strict=False)) + "]"


def _destination(req: Any, info: _Stored, planner: LoadPlanner, off: int, n: int,
                 part: bool) -> tuple[Any, memoryview]:
    """(the destination tensor when the bytes go straight into it, else None; the buffer to read into).

    Straight in when DCP's destination is a contiguous CPU tensor of the dtype and of the shape
    read (the whole item, or the part `_byte_range` found); wherever the allocator placed it."""
    if req.type == LoadItemType.BYTE_IO or not n:
        return None, memoryview(bytearray(n))
    shape = tuple(req.lengths) if part else tuple(info.shape or ())
    if part or (all(o == 0 for o in req.storage_offsets) and tuple(req.lengths) == shape):
        target = planner.resolve_tensor(req).detach()
        if (target.device.type == "cpu" and target.is_contiguous() and tuple(target.shape) == shape
                and str(target.dtype).removeprefix("torch.") == info.dtype):
            return target, byte_view(target.data_ptr(), n)    # _read holds target beside the view
    # Placed at the file offset's place in its page, so that O_DIRECT lands in it (io/fill.py).
    raw = torch.empty(n + pools.ALIGN, dtype=torch.uint8)
    shift = (off - raw.data_ptr()) % pools.ALIGN
    return None, memoryview(raw[shift:shift + n].numpy())  # type: ignore[arg-type]


@functools.lru_cache(maxsize=64)
def _dtype(name: str) -> torch.dtype | None:
    """The torch dtype a metadata entry names (once per name, not per item), None if it names none."""
    dt = getattr(torch, name, None)
    return dt if isinstance(dt, torch.dtype) else None


def _check_stored(path: Path, info: _Stored, sizes: dict[str, int]) -> None:
    """A location in DCP's metadata that the marker's files and the item's dtype/shape bear out."""
    size = sizes.get(info.relative_path)
    bad = None
    if size is None:
        bad = f"names {info.relative_path!r}, which the marker does not list"
    elif not (isinstance(info.offset, int) and isinstance(info.length, int) and 0 <= info.offset
              and 0 <= info.length and info.offset + info.length <= size):
        bad = f"places an item at bytes {info.offset}+{info.length} of {info.relative_path} ({size} bytes)"
    elif info.dtype is not None:
        dt = _dtype(info.dtype) if isinstance(info.dtype, str) else None
        if dt is None or info.shape is None:
            bad = f"records dtype {info.dtype!r}, not a torch dtype"
        else:
            if math.prod(info.shape) * dt.itemsize != info.length:
                bad = f"records {info.length} bytes for a {info.dtype} tensor of shape {tuple(info.shape)}"
    if bad is not None:
        raise IntegrityError(f"{path}: DCP metadata {bad}; the checkpoint is damaged — restore it from the "
                             "archive (tiered-ckpt restore)")
