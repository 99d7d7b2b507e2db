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
save id; final name, fsynced; not a dot-name, which the exporter skips; only DCP's classes and
builtins inside, so it unpickles without this package: docs/training.md) and last
``COMMITTED.json`` listing every file with its size and hash. The coordinator claims the name
through io/claim.py, the one claim-and-commit path `tc.save` takes too: the name's lock from
planning to the marker, a name committed here or in the archive refused (and one the archive
cannot be asked about, unless archive_check="best_effort"), stale files of never-committed saves
removed, the marker written last; a save that fails releases it (at once when the coordinator's own write failed,
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

import copy
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
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
from torch.distributed._shard._utils import narrow_tensor_by_index
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, StorageMeta, TensorStorageMetadata
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
from tiered_ckpt.config import ArchiveConfig, IoConfig, NodeConfig
from tiered_ckpt.config import load as load_config
from tiered_ckpt.errors import ConflictError, IntegrityError, UserError
from tiered_ckpt.io import commit, fill, fsafe, lock, mounts, pools
from tiered_ckpt.io.claim import Claim
from tiered_ckpt.io.fill import Pieces
from tiered_ckpt.io.hashing import hash_path, new_hasher
from tiered_ckpt.io.layout import SHARD, FilePlan, Segment, new_save_id
from tiered_ckpt.io.marker import MARKER, FileEntry, Manifest
from tiered_ckpt.io.options import IoOptions, WriteOptions
from tiered_ckpt.io.pipeline import Pipeline
from tiered_ckpt.io.posix import os_error, write_small
from tiered_ckpt.io.sources import Source, byte_view, to_source
from tiered_ckpt.lifecycle import reuse
from tiered_ckpt.logs import fields
from tiered_ckpt.naming import DEFAULT as DEFAULT_NAMING
from tiered_ckpt.naming import SCHEMES, CheckpointId, make_id, parse_name, require_name, scheme

log = logging.getLogger(__name__)

__all__ = ["DIGEST", "METADATA", "RAW", "TieredReader", "TieredWriter", "is_dcp_checkpoint", "metadata_name"]

METADATA = "dcp.{sid}.metadata"
# The transform descriptor of a tensor item stored as its raw bytes (dtype and shape are in DCP's
# own TensorStorageMetadata). DCP's FileSystemReader torch.load()s every tensor item; this name
# makes it stop with "Unknown extension name='tiered_ckpt.raw'" instead of misreading the bytes
# (docs/training.md: `tiered-ckpt convert NAME --to dcp DIR` writes a stock directory).
RAW = "tiered_ckpt.raw/1"
# The transform descriptor of a non-tensor (BYTE_IO) item: DIGEST + the xxh3-128 of its bytes, which
# the reader checks before DCP's planner torch.load()s them (dcp_pickle). A plain string in DCP's
# own `_StorageInfo`, so the metadata still unpickles without this package; FileSystemReader stops
# at it with "Unknown extension name='tiered_ckpt.xxh3'", as at RAW (convert drops both).
DIGEST = "tiered_ckpt.xxh3/"
# DCP's metadata format version, as FileSystemWriter stamps it (filesystem.CURRENT_DCP_VERSION).
DCP_VERSION = "1.0.0"
# A WriteResult that carries a rank's file entries to the coordinator; never part of the metadata.
_FILES_FQN = "__tiered_ckpt_files__"


def metadata_name(save_id: str) -> str:
    return METADATA.format(sid=save_id)


def is_dcp_checkpoint(manifest: Manifest) -> bool:
    """Whether a committed checkpoint was written by TieredWriter (its marker lists DCP metadata)."""
    return manifest.save_id is not None and any(f.path == metadata_name(manifest.save_id) for f in manifest.files)


@dataclass(frozen=True)
class _Stored:
    """Where one item's bytes are, as the reader uses it. Built from DCP's own `_StorageInfo`
    entries and TensorStorageMetadata (what the metadata holds since format 2, so that it
    unpickles without this package); checkpoints of format 1 pickled this class itself."""

    relative_path: str
    offset: int
    length: int
    dtype: str | None = None                 # tensors: raw bytes of this dtype and shape
    shape: tuple[int, ...] | None = None
    encoded: bool = False                    # a tensor as torch.save bytes (stock DCP's format)
    # BYTE_IO items: xxh3-128 of the item's bytes, checked before DCP's planner unpickles them
    # (dcp_pickle); None in checkpoints saved before it was recorded (then the whole file is hashed).
    hash: str | None = None


def _info(relative_path: str, offset: int, length: int, raw: bool, digest: str | None = None) -> _StorageInfo:
    """DCP's own location record: RAW for a raw tensor, the DIGEST tag for a non-tensor item."""
    descriptors = [RAW] if raw else [DIGEST + digest] if digest is not None else None
    return _StorageInfo(relative_path, offset, length, descriptors)


def _locations(md: Metadata) -> dict[MetadataIndex, _Stored]:
    """storage_data as _Stored entries: DCP `_StorageInfo` (raw tensors carry RAW; tensors without
    it are torch.save bytes, as FileSystemWriter writes them; a non-tensor item's DIGEST tag becomes
    `_Stored.hash`) or a format-1 `_Stored`."""
    out: dict[MetadataIndex, _Stored] = {}
    chunks: dict[str, dict[tuple[int, ...], tuple[int, ...]]] = {}     # fqn -> chunk offsets -> sizes
    for index, sd in (md.storage_data or {}).items():
        if isinstance(sd, _Stored):
            out[index] = sd
            continue
        if not isinstance(sd, _StorageInfo):
            continue              # reported per item by _read: no valid location
        descriptors = list(getattr(sd, "transform_descriptors", None) or ())
        tags = [d for d in descriptors if isinstance(d, str) and d.startswith(DIGEST)]
        digest = tags[0].removeprefix(DIGEST) if len(tags) == 1 else None
        if tags:
            descriptors = [d for d in descriptors if d not in tags]
        tmd = md.state_dict_metadata.get(index.fqn)
        if descriptors == [RAW] and isinstance(tmd, TensorStorageMetadata):
            by_offset = chunks.get(index.fqn)
            if by_offset is None:
                by_offset = chunks[index.fqn] = {tuple(c.offsets): tuple(c.sizes) for c in tmd.chunks}
            sizes = by_offset.get(tuple(index.offset) if index.offset is not None else (0,) * len(tmd.size))
            if sizes is None:
                continue
            out[index] = _Stored(sd.relative_path, sd.offset, sd.length, str(tmd.properties.dtype).removeprefix("torch."),
                                 sizes)
        elif not descriptors:
            out[index] = _Stored(sd.relative_path, sd.offset, sd.length, encoded=isinstance(tmd, TensorStorageMetadata),
                                 hash=digest)
    return out


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
                        "or config=tiered_ckpt.config.NodeConfig(root=..., model=...), or checkpoint_id="
                        "'<root>/<model>/<name>' (also what dcp.save/dcp.load(checkpoint_id=...) passes)")
    return Path(root), model


def parse_checkpoint_id(checkpoint_id: str | os.PathLike[str], naming: str | None = None) -> tuple[Path, str, CheckpointId]:
    """(root, model, id) of a checkpoint directory path: ``<root>/<model>/<name>``, where name is
    a checkpoint name of `naming` (None: of any built-in scheme, e.g. torchtitan's
    ``<folder>/step-100``); anything else is a UserError that says which paths are accepted."""
    p = Path(os.fspath(checkpoint_id)).absolute()
    cid = parse_name(p.name, naming) if naming is not None else None
    if cid is None:
        cid = next((c for c in (parse_name(p.name, k) for k in SCHEMES) if c is not None), None)
    if cid is None or len(p.parts) < 3:
        forms = ", ".join(s.pattern for s in SCHEMES.values())
        raise UserError(f"checkpoint_id={os.fspath(checkpoint_id)!r}: the tiered backend keeps checkpoints at "
                        f"<root>/<model>/<name>, with a name that orders them ({forms}; e.g. "
                        f"{p.parent / 'global_epoch0_step100'}); pass such a path, or "
                        "TieredWriter(root, model, epoch=, step=) without checkpoint_id")
    return p.parent.parent, p.parent.name, cid


def _valid_id(checkpoint_id: Any) -> bool:
    try:
        parse_checkpoint_id(checkpoint_id)
    except (UserError, TypeError, ValueError):
        return False
    return True


def _which(root: str | os.PathLike[str] | None, model: str | None, name: str | None, epoch: int | None,
           step: int | None, config: NodeConfig | None, checkpoint_id: str | os.PathLike[str] | None,
           ) -> tuple[str, Path, str, CheckpointId, bool]:
    """(naming, root, model, id, bound) of the checkpoint a TieredWriter or TieredReader is given.

    Given nothing, it is unbound: dcp.save/load(storage_writer=TieredWriter(), checkpoint_id=path)
    binds it later (reset)."""
    naming = config.naming if config is not None else DEFAULT_NAMING
    if checkpoint_id is not None:
        return (naming, *parse_checkpoint_id(checkpoint_id, naming), True)
    if root is None and model is None and config is None and name is None and step is None:
        return naming, Path(), "", make_id(0, 0), False
    r, m = _resolve(root, model, config)
    return naming, r, m, _cid(name, epoch, step, naming), True


def _cid(name: str | None, epoch: int | None, step: int | None, naming: str = DEFAULT_NAMING) -> CheckpointId:
    """The checkpoint's id in the model's `naming:` scheme (step alone for the step-only schemes)."""
    if name is not None:
        return require_name(name, naming)
    if step is None or (epoch is None and scheme(naming).has_epoch):
        raise UserError("pass name='global_epoch{E}_step{S}' or epoch= and step= (which checkpoint to save or load)")
    return make_id(epoch or 0, step, naming)


class _Hold:
    """The coordinator's claim of the name (io/claim.py), released once.

    Kept apart from the writer so that a `weakref.finalize` of the writer can release it: a
    save that failed on another rank never calls back into this writer (DCP skips `finish`),
    so the claim is released by reset()/close(), or when the writer object is gone.
    """

    def __init__(self, claim: Claim, key: str) -> None:
        self.claim: Claim | None = claim
        self.key = key

    @property
    def dfd(self) -> int | None:
        return self.claim.dfd if self.claim is not None else None

    def close(self) -> None:
        claim, self.claim = self.claim, None
        with _held_lock:
            if _held.get(self.key) is self:
                del _held[self.key]
        if claim is not None:
            claim.abandon()     # after the marker: only releases; before: removes nothing but its own empty directory


# Lock files of checkpoint names this process's writers hold (flock conflicts within a process too).
_held: dict[str, _Hold] = {}
_held_lock = threading.Lock()


class TieredWriter(StorageWriter):
    """A DCP StorageWriter: rename-free, fsynced, committed by the toolkit's marker (module doc).

    options: the I/O knobs (files per rank, writer threads, block size, O_DIRECT, hashing,
    sync_buffer_bytes); fields left at None take `config.io` (or the IoConfig defaults).
    The archive the name is checked against is `config.archive`, else the node config file's
    (none configured: nothing to check); archive_check as for tiered_ckpt.save.
    """

    def __init__(self, root: str | os.PathLike[str] | None = None, model: str | None = None, *,
                 name: str | None = None, epoch: int | None = None, step: int | None = None,
                 config: NodeConfig | None = None, options: IoOptions | None = None,
                 checkpoint_id: str | os.PathLike[str] | None = None,
                 archive_check: str = "required") -> None:
        super().__init__()
        node = config if config is not None else load_config()
        self.archive: ArchiveConfig = node.archive
        # A node config file that says amlfs: a root created here must be on Lustre (_make_root).
        self._lustre = node.backend == "amlfs" and node.source is not None
        self.archive_check = reuse.require_archive_check(archive_check)
        self.naming, self.root, self.model, self.cid, self._bound = _which(
            root, model, name, epoch, step, config, checkpoint_id)
        self.use_collectives = True
        iocfg = config.io if config is not None else IoConfig()
        options = options if options is not None else IoOptions()
        self.opts: WriteOptions = options.resolve(iocfg)
        self.buffer_bytes = options.pool_bytes("sync", iocfg)
        self.is_coordinator = False
        self.rank: int | None = None
        self._hold: _Hold | None = None
        self._finalizer: weakref.finalize[Any, Any] | None = None
        self.save_id: str | None = None
        self._gathered: list[Any] | None = None

    @property
    def path(self) -> Path:
        return self.root / self.model / self.cid.name

    @property
    def checkpoint_id(self) -> str | None:
        """The checkpoint directory (DCP logs it; the same path dcp.save(checkpoint_id=...) takes)."""
        return str(self.path) if self._bound else None

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
        """A new save (DCP calls this with dcp.save's checkpoint_id): `<root>/<model>/<name>`
        (parse_checkpoint_id); without one, the same checkpoint again (refused once committed)."""
        self.close()      # a save that failed elsewhere never reached finish(): drop its claim
        if checkpoint_id:
            self.root, self.model, self.cid = parse_checkpoint_id(checkpoint_id, self.naming)
            self._bound = True
        self.save_id = None

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        if not self._bound:
            raise UserError("TieredWriter() was given no checkpoint: pass root=, model= and epoch=/step= (or name=), "
                            "or dcp.save(..., checkpoint_id='<root>/<model>/<name>')")
        self.is_coordinator = is_coordinator
        rank = kwargs.get("rank")
        self.rank = rank if isinstance(rank, int) else None
        self.use_collectives = bool(kwargs.get("use_collectives", True))

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
        self._gathered = None
        sid = new_save_id()
        failed: BaseException | None = None
        if self.is_coordinator:
            try:
                _make_root(self.root, self._lustre)
                self._claim_name()
            except BaseException as e:  # noqa: BLE001 - raised below, after the others heard of it
                failed = e
        if not self.use_collectives:
            # dcp.save(use_collectives=False): every rank plans alone, but the checkpoint still
            # has one claim and one marker: the others write once the coordinator has claimed
            # the name and cleared a crashed save's files, or stop with its reason (docs/training.md).
            said = _all_gather(str(failed) if failed is not None else None)
            why = next((w for w in said if w), None)
            if failed is None and why is not None:
                raise ConflictError(f"cannot save {self.path}: the coordinator could not claim it ({why}); "
                                    "this rank wrote nothing")
        if failed is not None:
            raise failed
        self.save_id = sid
        return [replace(p, storage_data=_Prefix(sid, i)) for i, p in enumerate(plans)]

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        prefix = plan.storage_data
        rank = self.rank if self.rank is not None else prefix.rank if isinstance(prefix, _Prefix) else 0
        fut: Future[list[WriteResult]] = Future()
        read: list[int] = []
        err: BaseException | None = None
        results: list[WriteResult] = []
        try:
            results = self._write(plan, planner, rank, read)
        except BaseException as e:  # noqa: BLE001 - DCP gathers it and fails every rank
            err = os_error(e, self.path) if isinstance(e, OSError) else e
        finally:
            # A TieredStager holding this save's staging memory may free it (and a caller waiting
            # for its tensors to be written may go on): this rank is done reading them.
            dcp_stage.notify_written(read + dcp_stage.addresses(getattr(planner, "state_dict", None)))
        if not self.use_collectives:
            # Without DCP's collectives the coordinator learns here what every rank wrote (or why not).
            mine = (None, results, getattr(planner, "metadata", None)) if err is None else (str(err), [], None)
            self._gathered = _all_gather(mine)
        if err is not None:
            if self.is_coordinator:
                self.close()    # DCP never calls finish after a failed write: release the name now
            fut.set_exception(err)  # type: ignore[arg-type]  # torch types it as T
        else:
            fut.set_result(results)
        return fut

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        """Coordinator: DCP's metadata under its final name, then the marker (written last)."""
        if not self.use_collectives:
            if not self.is_coordinator:
                return              # the coordinator commits every rank's files
            try:
                metadata, results = _merge(self.path, self._gathered)
            except BaseException:
                self.close()
                raise
        try:
            assert self.save_id is not None and self._dfd is not None
            entries: list[FileEntry] = []
            storage: dict[MetadataIndex, Any] = {}
            for rank_results in results:
                for wr in rank_results:
                    if wr.index.fqn == _FILES_FQN:
                        entries.extend(wr.storage_data)
                    else:
                        storage.setdefault(wr.index, wr.storage_data)
            # A copy: with plan caching DCP hands every save the same Metadata object. Only
            # builtins and DCP's own classes are pickled (it unpickles without this package).
            meta = StorageMeta(checkpoint_id=str(self.path), save_id=self.save_id,
                               modules=list(getattr(metadata.storage_meta, "modules", None) or []))
            data = pickle.dumps(replace(metadata, storage_data=storage, storage_meta=meta, version=DCP_VERSION))
            name = metadata_name(self.save_id)
            try:
                write_small(self._dfd, name, data)
            except OSError as e:
                raise os_error(e, self.path / name) from None
            h = new_hasher()
            h.update(data)
            entries.append(FileEntry(name, len(data), h.hexdigest(), 0))
            m = Manifest(epoch=self.cid.epoch, step=self.cid.step, files=entries, world_size=len(results),
                            index={}, save_id=self.save_id)
            assert self._hold is not None and self._hold.claim is not None
            self._hold.claim.commit(m)
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
        """Whether this writer can save at the path (`<root>/<model>/<name>`, parse_checkpoint_id).
        DCP itself only tries its own writers for a bare checkpoint_id (_storage_utils): pass
        storage_writer=TieredWriter() with it."""
        return _valid_id(checkpoint_id)

    def storage_meta(self) -> StorageMeta | None:
        return StorageMeta(checkpoint_id=self.checkpoint_id, save_id=self.save_id)

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
        # Every rank writes after the global plan: everything in the directory now is stale.
        claim = Claim.take(self.root, self.model, self.cid,
                           name_check=reuse.checks_for(self.root, self.model, self.cid.name, self.archive,
                                                       self.archive_check))
        hold = _Hold(claim, key)
        with _held_lock:
            _held[key] = hold
        self._hold = hold
        self._finalizer = weakref.finalize(self, hold.close)

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
                t = data.detach()
                if type(t) is not torch.Tensor:
                    # A tensor subclass (no plain storage of its own): torch.save bytes, as
                    # FileSystemWriter writes every tensor; read back with torch.load(weights_only).
                    enc = io.BytesIO()
                    torch.save(t, enc)
                    sources.append(to_source(item.index.fqn or "-", enc.getbuffer()))
                    metas.append((item.index, None, None, None))
                    continue
                read.append(t.data_ptr())
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
        for (index, dtype, _shape, digest), src, (fname, off) in zip(metas, sources, where, strict=True):
            results.append(WriteResult(index=index, size_in_bytes=src.nbytes,
                                       storage_data=_info(fname, off, src.nbytes, raw=dtype is not None, digest=digest)))
        results.append(WriteResult(index=MetadataIndex(_FILES_FQN), size_in_bytes=0, storage_data=entries))
        return results


def _make_root(root: Path, lustre: bool) -> None:
    """The checkpoint root, created like FileSystemWriter creates its directory (parents too);
    with `lustre` (the node config says backend amlfs) only on a Lustre mount."""
    m = mounts.not_lustre(root) if lustre and not root.exists() else None
    if m is not None:
        raise UserError(f"checkpoint root {root} does not exist, and creating it would put it on {m.point} "
                        f"({m.fstype}), not on Lustre: the node config says backend: amlfs, so checkpoints "
                        "there would never be archived. Mount the AMLFS file system (the node boot mounts it; "
                        "check with findmnt -t lustre), or pass a root on it, or set backend: local for a "
                        "directory of this machine")
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise os_error(e, root) from None
    commit.require_root(root)


def _all_gather(obj: Any) -> list[Any]:
    """Every rank's `obj` (the default process group; just ours without torch.distributed)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return [obj]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def _merge(path: Path, gathered: list[Any] | None) -> tuple[Metadata, list[list[WriteResult]]]:
    """One checkpoint from the ranks' own plans (dcp.save(use_collectives=False)): the union of
    their metadata (a chunk or object saved by several ranks is kept once, the first's)."""
    assert gathered is not None
    bad = [f"rank {r}: {why}" for r, (why, _res, _md) in enumerate(gathered) if why]
    if bad:
        raise IntegrityError(f"cannot commit {path}: " + "; ".join(bad) + "; the checkpoint was not committed")
    mds = [md for _why, _res, md in gathered]
    if any(not isinstance(md, Metadata) for md in mds):
        raise UserError("dcp.save(use_collectives=False) with TieredWriter needs a planner that keeps its global "
                        "metadata (DCP's DefaultSavePlanner does): use it, or save with use_collectives=True")
    sdm: dict[str, Any] = {}
    planner_data: dict[Any, Any] = {}
    for md in mds:
        for fqn, item in md.state_dict_metadata.items():
            have = sdm.get(fqn)
            if have is None:
                sdm[fqn] = copy.deepcopy(item)
            elif isinstance(have, TensorStorageMetadata) and isinstance(item, TensorStorageMetadata):
                known = {tuple(c.offsets) for c in have.chunks}
                have.chunks.extend(c for c in item.chunks if tuple(c.offsets) not in known)
        if isinstance(md.planner_data, dict):
            for k, v in md.planner_data.items():
                planner_data.setdefault(k, v)
    first = mds[0]
    return (replace(first, state_dict_metadata=sdm, planner_data=planner_data or first.planner_data),
            [res for _why, res, _md in gathered])


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

    The marker and the sizes of every file are checked inside `dcp.load` (read_metadata, on
    every rank; `manifest` or `checked_metadata()` check them outside it). Whatever is unpickled
    is hashed first, always, by the rank that unpickles it: DCP's metadata against the marker
    (then unpickled with an allow-list, dcp_pickle) and each non-tensor item against the digest
    the metadata records for it (DIGEST). With `verify_hash=True` every data file's xxh3-128 too
    (shared among the ranks). Which checkpoint: root/model with name= or epoch=/step=, or
    checkpoint_id='<root>/<model>/<name>' (here or through dcp.load(checkpoint_id=...), see
    parse_checkpoint_id).
    """

    def __init__(self, root: str | os.PathLike[str] | None = None, model: str | None = None, *,
                 name: str | None = None, epoch: int | None = None, step: int | None = None,
                 config: NodeConfig | None = None, verify_hash: bool = False,
                 checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        super().__init__()
        self.naming, self.root, self.model, self.cid, self._bound = _which(
            root, model, name, epoch, step, config, checkpoint_id)
        self.verify_hash = verify_hash
        self.io = config.io if config is not None else IoConfig()    # reader threads, block size, O_DIRECT
        self.storage_data: dict[MetadataIndex, _Stored] = {}
        self._manifest: Manifest | None = None
        self._deferred: BaseException | None = None
        self._metadata: Metadata | None = None      # checked_metadata(), once per checkpoint
        self._hashed: set[str] = set()          # files hashed whole by this reader (old BYTE_IO items)

    @property
    def path(self) -> Path:
        return self.root / self.model / self.cid.name

    @property
    def checkpoint_id(self) -> str | None:
        return str(self.path) if self._bound else None

    @property
    def manifest(self) -> Manifest:
        """The checkpoint's marker, checked (IntegrityError/UserError when it is not a committed DCP checkpoint)."""
        if self._manifest is None:
            self._manifest = self._check()
        return self._manifest

    def _check(self) -> Manifest:
        if not self._bound:
            raise UserError("TieredReader() was given no checkpoint: pass root=, model= and epoch=/step= (or name=), "
                            "or dcp.load(..., checkpoint_id='<root>/<model>/<name>')")
        m, why = commit.read_marker_checked(self.path, anchor=self.root)
        if m is None:
            raise IntegrityError(f"{self.path} is not a committed checkpoint ({why or 'no ' + MARKER}); "
                                 "a save that did not finish is never loaded: load another checkpoint (tiered-ckpt list)")
        problems = commit.size_problems(self.path, m, anchor=self.root)
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
        self._deferred = None
        if checkpoint_id:
            self.root, self.model, self.cid = parse_checkpoint_id(checkpoint_id, self.naming)
            self._bound = True
            self._manifest = None
            self._metadata = None
            self._hashed = set()

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        """DCP's metadata. Inside dcp.load a checkpoint that cannot be loaded surfaces from
        set_up_storage_reader (DCP swallows read_metadata's exceptions into "metadata is None"):
        its metadata reads as empty here, and that call raises the reason."""
        try:
            return self.checked_metadata()
        except (IntegrityError, UserError, OSError) as e:
            self._deferred = e
            return Metadata(state_dict_metadata={}, storage_meta=StorageMeta(checkpoint_id=self.checkpoint_id))

    def checked_metadata(self) -> Metadata:
        """DCP's metadata of the committed checkpoint, or the reason it cannot be loaded (raised).

        Read once per checkpoint: the marker and sizes checked (with verify_hash, this rank's share
        of the data files hashed), then the metadata's bytes hashed against the marker on every
        rank before they are unpickled, with an allow-list (dcp_pickle)."""
        if self._metadata is not None:
            return self._metadata
        m = self.manifest
        if self.verify_hash:
            self._verify_hashes(m)
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
        md = dcp_pickle.load_metadata(data, path)
        if getattr(md, "storage_meta", None) is None:
            md.storage_meta = StorageMeta()
        self._metadata = md
        return md

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        deferred, self._deferred = self._deferred, None
        if deferred is not None:
            raise deferred
        self.storage_data = _locations(metadata)

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
        """Whether the path is a checkpoint directory this reader serves (parse_checkpoint_id) holding a marker."""
        if not _valid_id(checkpoint_id):
            return False
        return os.path.isfile(os.path.join(os.fspath(checkpoint_id), MARKER))

    # -- ours ----------------------------------------------------------------------------
    def _verify_hashes(self, m: Manifest) -> None:
        import torch.distributed as dist

        rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_available() and dist.is_initialized() else (0, 1)
        meta = metadata_name(m.save_id) if m.save_id is not None else None
        for i, f in enumerate(m.files):
            if i % world != rank or f.hash is None or f.path == meta:   # metadata: every rank, checked_metadata()
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

        def stream(e: FileEntry, view: memoryview) -> str | None:   # every file here has pieces
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
            if info.encoded:
                # torch.save bytes (a tensor subclass, or a stock DCP checkpoint): as FileSystemReader loads them.
                t = torch.load(io.BytesIO(view), map_location="cpu", weights_only=True)
                t = narrow_tensor_by_index(t, req.storage_offsets, req.lengths)
            else:
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
