"""The Python API for training code: save, async_save, load, latest.

    import tiered_ckpt as tc
    tc.save({"model": weights, "optim": state}, epoch=3, step=12000)          # returns once committed
    h = tc.async_save(state, epoch=3, step=13000)   # returns once snapshotted
    ...; h.wait()                                   # committed (or raises)
    state = tc.load()                               # newest committed checkpoint

Settings come from the node config (/etc/tiered-ckpt/config.yaml, $TIERED_CKPT_CONFIG) unless
passed: root, model, and the io section (threads, files_per_rank, block_size, direct,
staging_bytes, sync_buffer_bytes).
"""
from __future__ import annotations

from collections.abc import Callable, Mapping
from concurrent.futures import Future
from pathlib import Path
from typing import Any

from tiered_ckpt import config as config_mod
from tiered_ckpt.distributed import detect
from tiered_ckpt.errors import IntegrityError, UserError
from tiered_ckpt.io import commit as mf
from tiered_ckpt.io import pools as staging
from tiered_ckpt.io import reader, writer
from tiered_ckpt.io.sources import to_sources
from tiered_ckpt.io.writer import SaveResult, WriteOptions
from tiered_ckpt.naming import CheckpointId, require_name, require_number


class SaveHandle:
    """An async save in flight: wait() -> SaveResult (raises its error), done(), exception()."""

    def __init__(self, future: Future[SaveResult], name: str) -> None:
        self._f, self.name = future, name

    def wait(self, timeout: float | None = None) -> SaveResult:
        return self._f.result(timeout)

    def done(self) -> bool:
        return self._f.done()

    def exception(self, timeout: float | None = None) -> BaseException | None:
        return self._f.exception(timeout)


def _cfg(config: config_mod.NodeConfig | None, root: str | Path | None, model: str | None) -> config_mod.NodeConfig:
    cfg = config if config is not None else config_mod.load()
    return cfg.with_overrides(root=str(root) if root is not None else None, model=model)


def _cid(name: str | None, epoch: int | None, step: int | None) -> CheckpointId:
    if name is not None:
        if epoch is not None or step is not None:
            raise UserError("pass either name= or epoch= and step=, not both")
        return require_name(name)
    if epoch is None or step is None:
        raise UserError("name the checkpoint: pass epoch= and step= (or name='global_epoch<E>_step<S>')")
    return CheckpointId(require_number(epoch, "epoch"), require_number(step, "step"))


def _options(cfg: config_mod.NodeConfig, files: int | None, threads: int | None, block_size: int | None,
             direct: bool | None, hash: bool, barrier_timeout: float) -> WriteOptions:
    io = cfg.io
    opts = WriteOptions(
        files=files or io.files_per_rank, threads=threads or io.threads, block_size=block_size or io.block_size,
        direct=io.direct if direct is None else direct, hash=hash, barrier_timeout=barrier_timeout,
    )
    if opts.block_size % staging.ALIGN or opts.files < 1 or opts.threads < 1:
        raise UserError(f"files={opts.files}, threads={opts.threads}, block_size={opts.block_size}: need >= 1, >= 1 and a multiple of 4 KiB")
    return opts


def _begin(state: Mapping[str, Any], *, epoch: int | None, step: int | None, name: str | None,
           root: str | Path | None, model: str | None, config: config_mod.NodeConfig | None,
           rank: int | None, world_size: int | None, group: Any, files: int | None, threads: int | None,
           block_size: int | None, direct: bool | None, hash: bool, overwrite_incomplete: bool,
           save_id: str | None, barrier_timeout: float, pool_kind: str, pool_bytes: int | None,
           progress: Callable[[int], None] | None) -> writer.Save:
    comm = detect(rank, world_size, group, timeout=barrier_timeout)
    made: dict[str, Any] = {}

    def build() -> str | None:
        # Everything that can fail on one rank runs inside the agreement: the other ranks learn of
        # it (and fail too) instead of waiting for this one.
        cfg = made["cfg"] = _cfg(config, root, model)
        cid = made["cid"] = _cid(name, epoch, step)
        opts = _options(cfg, files, threads, block_size, direct, hash, barrier_timeout)
        sources = to_sources(state)
        size = pool_bytes if pool_bytes is not None else (cfg.io.staging_bytes if pool_kind == "staging" else cfg.io.sync_buffer_bytes)
        pool = staging.pool(pool_kind, size, opts.block_size)
        s = made["save"] = writer.Save(Path(cfg.root), cfg.model, cid, sources, comm, opts, pool,
                                       overwrite_incomplete=overwrite_incomplete, save_id=save_id, progress=progress,
                                       archive=cfg.archive)
        return s.prepare_local()

    def failed(exc: BaseException) -> None:
        s = made.get("save")
        if s is not None:
            s.on_failure(exc)
        elif comm.world_size > 1 and not comm.uses_torch and "cid" in made and isinstance(save_id, str) \
                and writer.SAVE_ID.fullmatch(save_id):
            # file mode, failed before the save was set up: still leave the note the others wait for
            writer.note_failure(Path(made["cfg"].root), made["cfg"].model, made["cid"], comm.rank, comm.world_size,
                                save_id, exc)

    about = name[:80] if isinstance(name, str) else "the checkpoint"   # for messages only: no user value parsed here
    ids = comm.phase("preparing", about, build, failed)
    s = made["save"]
    s.started(ids)
    return s


def save(state: Mapping[str, Any], *, epoch: int | None = None, step: int | None = None, name: str | None = None,
         root: str | Path | None = None, model: str | None = None, config: config_mod.NodeConfig | None = None,
         rank: int | None = None, world_size: int | None = None, group: Any = None,
         files: int | None = None, threads: int | None = None, block_size: int | None = None,
         direct: bool | None = None, hash: bool = True, overwrite_incomplete: bool = True,
         save_id: str | None = None, barrier_timeout: float = 600.0, buffer_bytes: int | None = None,
         progress: Callable[[int], None] | None = None) -> SaveResult:
    """Write `state` (name -> buffer) as checkpoint global_epoch{E}_step{S}; returns once committed.

    Adds at most io.sync_buffer_bytes (or buffer_bytes) of memory, whatever the checkpoint's size.
    """
    s = _begin(state, epoch=epoch, step=step, name=name, root=root, model=model, config=config, rank=rank,
               world_size=world_size, group=group, files=files, threads=threads, block_size=block_size,
               direct=direct, hash=hash, overwrite_incomplete=overwrite_incomplete, save_id=save_id,
               barrier_timeout=barrier_timeout, pool_kind="sync", pool_bytes=buffer_bytes, progress=progress)
    try:
        s.produce()
    except BaseException as e:   # e.g. KeyboardInterrupt: the other ranks still learn of it
        s.fail(e)
        try:
            s.finish()
        except BaseException:  # noqa: BLE001 - the original interruption is what the caller sees
            pass
        raise
    return s.finish()


def async_save(state: Mapping[str, Any], *, epoch: int | None = None, step: int | None = None, name: str | None = None,
               root: str | Path | None = None, model: str | None = None, config: config_mod.NodeConfig | None = None,
               rank: int | None = None, world_size: int | None = None, group: Any = None,
               files: int | None = None, threads: int | None = None, block_size: int | None = None,
               direct: bool | None = None, hash: bool = True, overwrite_incomplete: bool = True,
               save_id: str | None = None, barrier_timeout: float = 600.0, staging_bytes: int | None = None,
               zero_copy: bool = False, progress: Callable[[int], None] | None = None) -> SaveHandle:
    """Start a save; returns once the buffers are snapshotted into the staging area.

    A checkpoint larger than the staging area streams through it: the call returns once the
    remainder fits. With zero_copy=True nothing is snapshotted and the call returns at once; the
    caller must not touch its buffers until wait() returns (a size change is detected and
    fails the save; nothing is committed).
    """
    s = _begin(state, epoch=epoch, step=step, name=name, root=root, model=model, config=config, rank=rank,
               world_size=world_size, group=group, files=files, threads=threads, block_size=block_size,
               direct=direct, hash=hash, overwrite_incomplete=overwrite_incomplete, save_id=save_id,
               barrier_timeout=barrier_timeout, pool_kind="sync" if zero_copy else "staging",
               pool_bytes=staging_bytes if not zero_copy else None, progress=progress)
    return SaveHandle(writer.run_async(s, zero_copy), s.cid.name)


def latest(*, root: str | Path | None = None, model: str | None = None,
           config: config_mod.NodeConfig | None = None) -> mf.CheckpointInfo | None:
    """The newest committed checkpoint (by epoch, step), found by scanning markers; None if none."""
    cfg = _cfg(config, root, model)
    return mf.latest_committed(cfg.root, cfg.model)


def load(name: str | None = None, *, root: str | Path | None = None, model: str | None = None,
         config: config_mod.NodeConfig | None = None, rank: int | None = None, into: Mapping[str, Any] | None = None,
         verify_hash: bool = False, threads: int | None = None, direct: bool | None = None,
         progress: Callable[[int], None] | None = None) -> dict[str, Any]:
    """Read a committed checkpoint (default: the newest) into buffers: `into` ones, else new ones.

    Sizes are always checked; content hashes when verify_hash=True.
    """
    cfg = _cfg(config, root, model)
    mf.require_root(cfg.root)
    if name is None:
        info = mf.latest_committed(cfg.root, cfg.model)
        if info is None:
            raise IntegrityError(f"no committed checkpoint under {Path(cfg.root) / cfg.model}")
    else:
        require_name(name)
        found = mf.find(cfg.root, cfg.model, name)
        if found is None:
            raise UserError(f"checkpoint {name} not found under {Path(cfg.root) / cfg.model} (tiered-ckpt list shows what is there)")
        info = found
    if rank is None:
        rank = detect().rank
    return reader.load(info, rank=rank, into=into, check_hash=verify_hash, threads=threads or cfg.io.threads,
                       block_size=cfg.io.block_size, direct=cfg.io.direct if direct is None else direct, progress=progress)
