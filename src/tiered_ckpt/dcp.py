"""torch.distributed.checkpoint (DCP) storage for the toolkit's commit protocol.

    import torch.distributed.checkpoint as dcp
    from tiered_ckpt.dcp import TieredReader, TieredWriter
    dcp.save(state, storage_writer=TieredWriter(root, model, epoch=3, step=12000))
    dcp.load(state, storage_reader=TieredReader(root, model, epoch=3, step=12000))

DCP's own FileSystemWriter commits by writing ``.metadata.tmp`` and renaming it; AMLFS
auto-export never propagates a rename, so the archive would never see the metadata. Here
nothing is renamed: every rank writes its items (tensor bytes raw, non-tensor objects as the
bytes DCP serialized) into one shard file under its final name (``shard-r00000-000.<sid>.bin``,
the save id in every name, as the native writer does), hashing inline (xxh3-128) and fsyncing;
the coordinator then writes DCP's pickled Metadata as ``dcp.<sid>.metadata`` (final name,
fsynced; not a dot-name, which the exporter skips) and last ``COMMITTED.json`` listing every
file with its size and hash. The coordinator holds the checkpoint name's lock from planning to
the marker and refuses a name that is already committed.

Resharding (load at another world size, DTensor placements) is DCP's planner's job; the reader
only serves the byte ranges it asks for, after checking the marker. Torch is imported here only:
the rest of the toolkit works without it.
"""
from __future__ import annotations

import gc
import io
import os
import pickle
import threading
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

from tiered_ckpt.config import NodeConfig
from tiered_ckpt.errors import ConflictError, IntegrityError, UserError
from tiered_ckpt.io import commit as mf
from tiered_ckpt.io import fsafe, lock
from tiered_ckpt.io.hashing import hash_path, new_hasher
from tiered_ckpt.io.layout import SHARD, new_save_id
from tiered_ckpt.io.posix import fsync_parents, open_data, open_subdir, os_error, pwrite_all, write_small
from tiered_ckpt.naming import DEFAULT as DEFAULT_NAMING
from tiered_ckpt.naming import CheckpointId, make_id, require_name, scheme

__all__ = ["METADATA", "TieredReader", "TieredWriter", "is_dcp_checkpoint", "metadata_name"]

METADATA = "dcp.{sid}.metadata"
# A WriteResult that carries a rank's file entries to the coordinator; never part of the metadata.
_FILES_FQN = "__tiered_ckpt_files__"


# The names this process's writers hold claims on: the writer and the thread whose save took it.
_held: dict[str, tuple[weakref.ref[TieredWriter], threading.Thread]] = {}
_held_lock = threading.Lock()


def _drop_stale_claim(path: Path, me: TieredWriter) -> None:
    """Release a claim on `path` that this process still holds for a save that is over.

    When a save fails on any rank after planning, DCP calls nothing more on the coordinator's
    writer (its all_reduce/reduce_scatter just raise CheckpointException), so that writer keeps
    the claim until it is garbage, and a failed save's traceback keeps it alive in a reference
    cycle: the retry of the name would be refused as "locked". A thread runs one save at a time,
    so a claim taken by this very thread, or by a thread that has ended, belongs to a save that
    is over; one of another live thread (an async save in flight) is released only if its
    writer is garbage.
    """
    with _held_lock:
        entry = _held.get(os.path.abspath(path))
    holder = entry[0]() if entry is not None else None
    if entry is None or holder is None or holder is me:
        return
    if entry[1] is threading.current_thread() or not entry[1].is_alive():
        holder.close()
    else:
        del holder
        gc.collect()      # runs the __del__ of an unreferenced writer (PEP 442: also in a cycle)


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


def _raw(t: torch.Tensor) -> memoryview:
    """The bytes of a tensor's projection (contiguous, on the CPU)."""
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    t = t.contiguous()
    if t.numel() == 0:
        return memoryview(b"")
    return memoryview(t.reshape(-1).view(torch.uint8).numpy())  # type: ignore[arg-type]  # ndarray is a buffer


class TieredWriter(StorageWriter):
    """A DCP StorageWriter: rename-free, fsynced, committed by the toolkit's marker (module doc)."""

    def __init__(self, root: str | os.PathLike[str] | None = None, model: str | None = None, *,
                 name: str | None = None, epoch: int | None = None, step: int | None = None,
                 config: NodeConfig | None = None) -> None:
        super().__init__()
        self.root, self.model = _resolve(root, model, config)
        self.naming = config.naming if config is not None else DEFAULT_NAMING
        self.cid = _cid(name, epoch, step, self.naming)
        self.is_coordinator = False
        self._claim: ExitStack | None = None
        self._dfd: int | None = None
        self.save_id: str | None = None

    @property
    def path(self) -> Path:
        return self.root / self.model / self.cid.name

    # -- StorageWriter -------------------------------------------------------------------
    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        self.close()      # a save that failed elsewhere never reached finish(): drop its claim
        if checkpoint_id:
            p = Path(checkpoint_id)
            self.root, self.model, self.cid = p.parent.parent, p.parent.name, require_name(p.name, self.naming)
        self.save_id = None

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self.is_coordinator = is_coordinator

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        """Coordinator: claim the name, refuse a committed one, clear a crashed save's files, pick the save id."""
        self.close()
        sid = new_save_id()
        mf.require_root(self.root)
        self._claim_name()
        self.save_id = sid
        return [replace(p, storage_data=_Prefix(sid, i)) for i, p in enumerate(plans)]

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        prefix = plan.storage_data
        assert isinstance(prefix, _Prefix)
        self.save_id = prefix.save_id
        fut: Future[list[WriteResult]] = Future()
        try:
            fut.set_result(self._write(plan, planner, prefix))
        except OSError as e:
            fut.set_exception(os_error(e, self.path))  # type: ignore[arg-type]  # torch types it as T
        except BaseException as e:  # noqa: BLE001 - DCP gathers it and fails every rank
            fut.set_exception(e)  # type: ignore[arg-type]  # torch types it as T
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
            metadata.storage_data = storage
            data = pickle.dumps(metadata)
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
        finally:
            self.close()

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return False      # never picked automatically: the caller passes storage_writer= explicitly

    def storage_meta(self) -> StorageMeta | None:
        return StorageMeta(checkpoint_id=str(self.path), save_id=self.save_id or "")

    # -- ours ----------------------------------------------------------------------------
    def close(self) -> None:
        """Release the name's claim and the directory (after finish, or a save that failed)."""
        claim, self._claim = self._claim, None
        if claim is not None:
            with _held_lock:
                entry = _held.get(os.path.abspath(self.path))
                if entry is not None and entry[0]() is self:
                    del _held[os.path.abspath(self.path)]
            claim.close()
        if self._dfd is not None:
            os.close(self._dfd)
            self._dfd = None

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass

    def _claim_name(self) -> None:
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
            _drop_stale_claim(self.path, self)
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
        self._claim, self._dfd = claim, dfd
        with _held_lock:
            _held[os.path.abspath(self.path)] = (weakref.ref(self), threading.current_thread())

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

    def _write(self, plan: SavePlan, planner: SavePlanner, prefix: _Prefix) -> list[WriteResult]:
        if not plan.items:
            return []
        name = SHARD.format(rank=prefix.rank, i=0, sid=prefix.save_id)
        dfd = self._dfd if self._dfd is not None else fsafe.open_dir(self.path, anchor=self.root)
        try:
            fd, _ = open_data(dfd, name, self.path / name, direct=False)
            try:
                h = new_hasher()
                offset = 0
                results: list[WriteResult] = []
                # Bytes items first (small), then tensors: the order does not matter to the reader.
                for item in sorted(plan.items, key=lambda i: i.type != WriteItemType.BYTE_IO):
                    data = planner.resolve_data(item)
                    if item.type == WriteItemType.BYTE_IO:
                        assert isinstance(data, io.BytesIO)
                        view = data.getbuffer()
                        info = _Stored(name, offset, len(view))
                    else:
                        assert isinstance(data, torch.Tensor)
                        view = _raw(data)
                        info = _Stored(name, offset, len(view), str(data.dtype).removeprefix("torch."),
                                       tuple(data.shape))
                    pwrite_all(fd, view, offset)
                    h.update(view)
                    offset += len(view)
                    results.append(WriteResult(index=item.index, size_in_bytes=info.length, storage_data=info))
                os.fsync(fd)
            finally:
                os.close(fd)
            os.fsync(dfd)
        finally:
            if dfd != self._dfd:
                os.close(dfd)
        files = [mf.FileEntry(name, offset, h.hexdigest(), prefix.rank)]
        results.append(WriteResult(index=MetadataIndex(_FILES_FQN), size_in_bytes=0, storage_data=files))
        return results


class TieredReader(StorageReader):
    """A DCP StorageReader of a committed checkpoint: refuses one without a valid marker.

    The marker and the sizes of every file are checked when it is made (on every rank, before
    `dcp.load`); with `verify_hash=True` every file's xxh3-128 too (shared among the ranks).
    """

    def __init__(self, root: str | os.PathLike[str] | None = None, model: str | None = None, *,
                 name: str | None = None, epoch: int | None = None, step: int | None = None,
                 config: NodeConfig | None = None, verify_hash: bool = False) -> None:
        super().__init__()
        self.root, self.model = _resolve(root, model, config)
        self.naming = config.naming if config is not None else DEFAULT_NAMING
        self.cid = _cid(name, epoch, step, self.naming)
        self.verify_hash = verify_hash
        self.storage_data: dict[MetadataIndex, _Stored] = {}
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

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        m = self.manifest
        if self.verify_hash:
            self._verify_hashes(m)
        assert m.save_id is not None
        name = metadata_name(m.save_id)
        data = fsafe.read_file(self.path / name, anchor=self.root)
        md = pickle.loads(data)   # noqa: S301 - DCP's own format is a pickle; its bytes match the marker's size
        if not isinstance(md, Metadata):
            raise IntegrityError(f"{self.path / name} is not DCP metadata; restore the checkpoint from the archive")
        if getattr(md, "storage_meta", None) is None:
            md.storage_meta = StorageMeta()
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
        for i, f in enumerate(m.files):
            if i % world != rank or f.hash is None:
                continue
            got = hash_path(str(self.path / f.path), anchor=self.root)
            if got != f.hash:
                raise IntegrityError(f"{self.path / f.path}: content hash {got} does not match the marker's {f.hash}; "
                                     "restore the checkpoint from the archive (tiered-ckpt restore)")

    def _read(self, plan: LoadPlan, planner: LoadPlanner) -> None:
        per_file: dict[str, list[Any]] = {}
        for req in plan.items:
            per_file.setdefault(self.storage_data[req.storage_index].relative_path, []).append(req)
        for rel, reqs in per_file.items():
            p = self.path / rel
            fd = fsafe.open_file(p, anchor=self.root)
            try:
                for req in sorted(reqs, key=lambda r: self.storage_data[r.storage_index].offset):
                    info = self.storage_data[req.storage_index]
                    buf = bytearray(info.length)
                    n = os.preadv(fd, [buf], info.offset) if info.length else 0
                    if n != info.length:
                        raise IntegrityError(f"{p}: short read at byte {info.offset + n} (expected {info.length} bytes); "
                                             "restore the checkpoint from the archive")
                    if req.type == LoadItemType.BYTE_IO:
                        planner.load_bytes(req, io.BytesIO(bytes(buf)))
                        continue
                    assert info.dtype is not None and info.shape is not None
                    dtype = getattr(torch, info.dtype)
                    t = (torch.frombuffer(buf, dtype=dtype) if info.length else torch.empty(0, dtype=dtype))
                    t = narrow_tensor_by_index(t.reshape(info.shape), req.storage_offsets, req.lengths)
                    target = planner.resolve_tensor(req).detach()
                    if target.size() != t.size():
                        raise IntegrityError(f"{p}: item {req.storage_index.fqn} has shape {tuple(t.size())}, the "
                                             f"state to load expects {tuple(target.size())}")
                    target.copy_(t)
                    planner.commit_tensor(req, target)
            finally:
                os.close(fd)
