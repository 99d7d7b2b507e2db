"""The Python API for training code: save, async_save, load, latest.

    import tiered_ckpt as tc
    tc.save({"model": weights, "optim": state}, epoch=3, step=12000)          # returns once committed
    h = tc.async_save(state, epoch=3, step=13000)   # returns once snapshotted
    ...; h.wait()                                   # committed (or raises)
    state = tc.load()                               # newest committed checkpoint
    tc.release_staging()                            # give async_save's staging memory back

Settings come from the node config ($TIERED_CKPT_CONFIG, else /etc/tiered-ckpt/config.yaml;
or config=) unless passed: root=, model=, and the I/O knobs as one `IoOptions` (options=),
whose fields left at None take the config's io section (tiered_ckpt.io.options says the
precedence and documents every field):

    from tiered_ckpt.io.options import IoOptions
    tc.save(state, epoch=3, step=12000, options=IoOptions(files=16, hash=False))
"""
from __future__ import annotations

import atexit
import logging
import threading
import time
from collections.abc import Callable, Collection, Mapping
from concurrent.futures import Future
from pathlib import Path
from typing import Any

from tiered_ckpt import config as config_mod
from tiered_ckpt import records
from tiered_ckpt.distributed import detect
from tiered_ckpt.errors import IntegrityError, UserError
from tiered_ckpt.io import commit, pools, reader, writer
from tiered_ckpt.io.layout import SAVE_ID
from tiered_ckpt.io.nested import flatten_state
from tiered_ckpt.io.options import IoOptions, WriteOptions
from tiered_ckpt.io.save_commit import note_failure
from tiered_ckpt.io.sources import Source, to_sources
from tiered_ckpt.io.writer import SaveResult
from tiered_ckpt.lifecycle import reuse
from tiered_ckpt.logs import fields
from tiered_ckpt.naming import DEFAULT as DEFAULT_NAMING
from tiered_ckpt.naming import CheckpointId, make_id, require_name, require_number, scheme

_DEFAULT = IoOptions()     # every field from the node config, or its documented default
log = logging.getLogger(__name__)


class SaveHandle:
    """An async save in flight: wait() -> SaveResult (raises its error), done(), exception().

    A failure nobody asked for (neither wait() nor exception() called) is raised by the next
    async_save of the process instead, before it starts.
    """

    def __init__(self, future: Future[SaveResult], name: str) -> None:
        self._f, self.name = future, name
        self.seen = False          # the caller has been given the outcome

    def wait(self, timeout: float | None = None) -> SaveResult:
        try:
            return self._f.result(timeout)
        finally:
            self.seen = self._f.done()

    def done(self) -> bool:
        return self._f.done()

    def exception(self, timeout: float | None = None) -> BaseException | None:
        err = self._f.exception(timeout)
        self.seen = True       # returned: the save ended (a timeout raises instead)
        return err

    def _wait_quietly(self) -> BaseException | None:
        return self._f.exception()


_previous: list[SaveHandle] = []       # this process's last async save (at most one)
_previous_lock = threading.Lock()


def _previous_outcome() -> None:
    """Before an async save: wait for the previous one (its staging memory is reused) and raise
    its failure if the caller never looked (otherwise it would go unnoticed)."""
    with _previous_lock:
        prev = _previous.pop() if _previous else None
    if prev is None:
        return
    err = prev._wait_quietly()
    if err is not None and not prev.seen:
        prev.seen = True
        raise err


def _cfg(config: config_mod.NodeConfig | None, root: str | Path | None, model: str | None) -> config_mod.NodeConfig:
    cfg = config if config is not None else config_mod.load()
    return cfg.with_overrides(root=str(root) if root is not None else None, model=model)


def _cid(name: str | None, epoch: int | None, step: int | None, naming: str = DEFAULT_NAMING) -> CheckpointId:
    if name is not None:
        if epoch is not None or step is not None:
            raise UserError("pass either name= or epoch= and step=, not both")
        return require_name(name, naming)
    if naming != DEFAULT_NAMING and epoch is None and step is not None:
        epoch = 0                 # a step-only scheme (step-{N}, checkpoint-{N}, iter_{N:07d})
    if epoch is None or step is None:
        if naming != DEFAULT_NAMING:
            raise UserError(f"name the checkpoint: pass step= (or name='{scheme(naming).example}')")
        raise UserError("name the checkpoint: pass epoch= and step= (or name='global_epoch<E>_step<S>')")
    return make_id(require_number(epoch, "epoch"), require_number(step, "step"), naming)


def _require_options(options: Any) -> IoOptions:
    if not isinstance(options, IoOptions):
        raise UserError(f"options={str(options)[:80]!r}: pass a tiered_ckpt.io.options.IoOptions, "
                        "e.g. options=IoOptions(files=16, threads=16)")
    return options


def _begin(state: Mapping[str, Any], *, epoch: int | None, step: int | None, name: str | None,
           root: str | Path | None, model: str | None, config: config_mod.NodeConfig | None,
           rank: int | None, world_size: int | None, group: Any, save_id: str | None, options: IoOptions,
           pool_kind: str, progress: Callable[[int], None] | None,
           replicated: Collection[str] | None = None, archive_check: str = "required",
           made: dict[str, Any] | None = None,
           stage: Callable[[list[Source], WriteOptions, config_mod.IoConfig],
                           tuple[list[Source], pools.BlockPool, bool]] | None = None
           ) -> tuple[writer.Save, config_mod.NodeConfig]:
    """Set up one rank's save; `made` (the caller's, for its error record) gets cfg, cid, save;
    `stage` (async_save's) snapshots the sources into staging memory instead of a write pool."""
    options = _require_options(options)
    comm = detect(rank, world_size, group, timeout=options.barrier_timeout)
    made = {} if made is None else made

    def build() -> tuple[str, str] | None:
        # Everything that can fail on one rank runs inside the agreement: the other ranks learn of
        # it (and fail too) instead of waiting for this one.
        cfg = made["cfg"] = _cfg(config, root, model)
        cid = made["cid"] = _cid(name, epoch, step, cfg.naming)
        opts = options.resolve(cfg.io)
        rep_keys = _require_replicated(replicated, state)
        split = bool(rep_keys) and comm.world_size > 1
        flat, structure = flatten_state(state, tree=split)
        sources = to_sources(flat)
        record = None
        if split:
            if structure is None:       # flatten_state(tree=True) always returns one
                raise RuntimeError("internal error: no structure tree for a save with replicated entries")
            sources, structure, record = writer.split_replicated(sources, structure, rep_keys, comm.rank,
                                                                 comm.world_size)
        background = False
        if stage is not None:
            sources, pool, background = stage(sources, opts, cfg.io)
        else:
            pool = pools.pool(pool_kind, options.pool_bytes(pool_kind, cfg.io), opts.block_size)
        s = made["save"] = writer.Save(Path(cfg.root), cfg.model, cid, sources, comm, opts, pool,
                                       overwrite_incomplete=options.overwrite_incomplete, save_id=save_id,
                                       progress=progress, structure=structure, replicated=record,
                                       name_check=reuse.checks_for(cfg.root, cfg.model, cid.name, cfg.archive,
                                                                   archive_check))
        s.start_in_produce = background
        return s.prepare_local()

    def failed(exc: BaseException) -> None:
        s = made.get("save")
        if s is not None:
            s.on_failure(exc)
        elif comm.world_size > 1 and not comm.uses_torch and "cid" in made and isinstance(save_id, str) \
                and SAVE_ID.fullmatch(save_id):
            # file mode, failed before the save was set up: still leave the note the others wait for
            note_failure(Path(made["cfg"].root), made["cfg"].model, made["cid"], comm.rank, comm.world_size,
                         save_id, exc)

    about = name[:80] if isinstance(name, str) else "the checkpoint"   # for messages only: no user value parsed here
    ids = comm.phase("preparing", about, build, failed)
    s = made["save"]
    s.started(ids)
    return s, made["cfg"]


def _require_replicated(replicated: Any, state: Any) -> list[str]:
    if replicated is None:
        return []
    if isinstance(replicated, (str, bytes)) or not isinstance(replicated, Collection) \
            or not all(isinstance(k, str) for k in replicated):
        raise UserError(f"replicated={str(replicated)[:80]!r}: pass a list of the state's top-level keys whose "
                        "data is the same on every rank, e.g. replicated=['model']")
    keys = list(dict.fromkeys(replicated))
    if isinstance(state, Mapping):
        missing = [k for k in keys if k not in state]
        if missing:
            raise UserError(f"replicated={missing!r}: not a top-level key of the state (it has "
                            f"{[str(k) for k in list(state)[:10]]})")
    return keys


def save(state: Mapping[str, Any], *, epoch: int | None = None, step: int | None = None, name: str | None = None,
         root: str | Path | None = None, model: str | None = None, config: config_mod.NodeConfig | None = None,
         rank: int | None = None, world_size: int | None = None, group: Any = None, save_id: str | None = None,
         options: IoOptions = _DEFAULT, progress: Callable[[int], None] | None = None,
         replicated: Collection[str] | None = None, archive_check: str = "required") -> SaveResult:
    """Write `state` as checkpoint global_epoch{E}_step{S} (or the model's `naming:` scheme, e.g.
    step-{N} from step= alone); returns once committed.

    `state`: name -> buffer (bytes, memoryview, numpy array, torch tensor), or nested: dicts
    (str or int keys), lists and tuples of buffers and JSON scalars (int, float, bool, str,
    None), e.g. {"model": model.state_dict(), "optim": opt.state_dict(), "step": 3}. load()
    returns the same structure (io.nested says what comes back as what).

    Adds at most io.sync_buffer_bytes (or options.buffer_bytes) of memory, whatever the
    checkpoint's size. `progress` is called with the bytes written since its last call.

    replicated=["model"]: top-level keys whose data is the same on every rank (data-parallel
    replicas). With several ranks their buffers are written once, spread over the ranks, and
    every rank's load() returns them. Each rank hashes them first; if they differ between ranks
    the save fails with an error naming the entry and nothing is committed.

    A name committed here or in the archive is refused (ConflictError). Where an archive is
    configured and cannot be asked, the save is refused too (UnavailableError, nothing written),
    unless archive_check="best_effort": then it goes on with a warning (docs/io.md, "Names that
    already exist", says what that risks).

    What else runs, on rank 0 after the commit: one line appended to the model's record
    (`tiered-ckpt metrics`), and, when metrics.textfile is set, a daemon thread that rewrites the
    node-exporter textfile: it lists the archive in Blob and, on AMLFS, runs `lfs hsm_state` and
    reads the auto-export job through ARM (calls with their own retries). save() never waits for
    it and its failures are logged, not raised; at interpreter exit an atexit hook waits for it
    up to 30 s, so a script's last save reaches the textfile and an unreachable archive cannot
    hold the exit longer.
    """
    called = time.monotonic()
    made: dict[str, Any] = {}
    try:
        s, cfg = _begin(state, epoch=epoch, step=step, name=name, root=root, model=model, config=config, rank=rank,
                        world_size=world_size, group=group, save_id=save_id, options=options, pool_kind="sync",
                        progress=progress, replicated=replicated, archive_check=archive_check, made=made)
    except BaseException as e:
        _failed("save", *_known(made, model, name), called, e)
        raise
    try:
        s.produce()
    except BaseException as e:   # e.g. KeyboardInterrupt: the other ranks still learn of it
        s.fail(e)
        try:
            s.finish()
        except BaseException:  # noqa: BLE001 - the original interruption is what the caller sees
            pass
        _failed("save", s.model, s.cid.name, called, e)
        raise
    try:
        res = s.finish()
    except BaseException as e:
        _failed("save", s.model, s.cid.name, called, e)
        raise
    return _recorded(s, res, cfg)


def _known(made: dict[str, Any], model: str | None, name: str | None) -> tuple[str | None, str | None]:
    """(model, checkpoint name) as far as the save got before it failed."""
    cfg, cid = made.get("cfg"), made.get("cid")
    return (cfg.model if cfg is not None else model), (cid.name if cid is not None else name)


def _failed(operation: str, model: str | None, name: str | None, since: float, e: BaseException) -> None:
    """One ERROR record for an operation that raised (the caller still gets the exception)."""
    log.error("%s of %s failed: %s", operation, name or "a checkpoint", str(e) or type(e).__name__,
              extra=fields(operation, model=model, checkpoint=name, duration_s=time.monotonic() - since,
                           outcome="error", error=type(e).__name__))


def _recorded(s: writer.Save, res: SaveResult, cfg: config_mod.NodeConfig) -> SaveResult:
    """Rank 0 leaves the save's record for `tiered-ckpt metrics` and refreshes the node-exporter
    textfile when metrics.textfile is set (best effort, never fails or delays the save)."""
    info = fields("save", model=s.model, checkpoint=res.name, duration_s=res.seconds, nbytes=res.bytes,
                  rank=res.rank, world_size=res.world_size, files=res.files)
    if res.rank == 0:
        records.record(s.root, s.model, records.SAVE,
                       {"name": res.name, "bytes": res.bytes, "seconds": res.seconds, "files": res.files,
                        "world_size": res.world_size},
                       totals={"saves": 1, "bytes": res.bytes})
        log.info("saved %s: %d bytes in %.2fs (%.2f GB/s, %d rank(s))", res.name, res.bytes, res.seconds,
                 res.bytes / res.seconds / 1e9 if res.seconds > 0 else 0.0, res.world_size, extra=info)
        if cfg.metrics.textfile:
            _refresh_textfile(cfg)
    else:       # one INFO line per save, not one per rank
        log.debug("rank %d wrote its part of %s", res.rank, res.name, extra=info)
    return res


# At most one textfile refresh runs at a time; a save during one asks for one more after it.
_textfile: dict[str, Any] = {"thread": None, "again": None}
_textfile_lock = threading.Lock()


def _refresh_textfile(cfg: config_mod.NodeConfig) -> None:
    """Rewrite metrics.textfile in a background thread: collecting looks at both tiers (a Blob
    listing, lfs hsm_state, ARM), which a training step must not wait for."""
    with _textfile_lock:
        t = _textfile["thread"]
        if t is not None and t.is_alive():
            _textfile["again"] = cfg
            return
        t = _textfile["thread"] = threading.Thread(target=_write_textfiles, args=(cfg,), daemon=True,
                                                   name="tiered-ckpt-metrics")
    t.start()


def _write_textfiles(cfg: config_mod.NodeConfig) -> None:
    from tiered_ckpt.lifecycle import metrics
    from tiered_ckpt.tiers.backends import make_backend

    while True:
        path = cfg.metrics.textfile
        try:
            if path is not None:
                metrics.write_textfile(cfg, make_backend(cfg), path)
        except Exception as e:  # noqa: BLE001 - metrics are best effort; the save is committed
            log.warning("could not refresh the metrics textfile %s: %s", path, e,
                        extra=fields("metrics", model=cfg.model, outcome="error"))
        with _textfile_lock:
            again, _textfile["again"] = _textfile["again"], None
            if again is None:
                return
            cfg = again


@atexit.register
def _flush_textfile(timeout: float = 30.0) -> None:
    """A script that exits right after its last save still leaves that save in the textfile
    (waits at most `timeout` seconds: an unreachable archive must not hold the exit)."""
    t = _textfile["thread"]
    if t is not None and t.is_alive():
        t.join(timeout)


def async_save(state: Mapping[str, Any], *, epoch: int | None = None, step: int | None = None, name: str | None = None,
               root: str | Path | None = None, model: str | None = None, config: config_mod.NodeConfig | None = None,
               rank: int | None = None, world_size: int | None = None, group: Any = None, save_id: str | None = None,
               options: IoOptions = _DEFAULT, zero_copy: bool = False,
               progress: Callable[[int], None] | None = None, replicated: Collection[str] | None = None,
               archive_check: str = "required") -> SaveHandle:
    """Start a save; returns once the buffers are snapshotted into the staging area.

    The staging area (io.pools.staging_area) holds what this save needs, no more: it grows the
    first time a save needs more, is reused by later saves, and is freed by release_staging().
    Its budget is io.staging_bytes (or options.staging_bytes): a checkpoint that needs more
    streams through a ring of that size, and the call returns once the remainder fits. CUDA
    tensors are copied on a side stream into page-locked staging.

    One async save runs at a time: the next one first waits for this one to end (and raises its
    failure if neither wait() nor exception() was called). With zero_copy=True nothing is
    snapshotted and the call returns at once (the save streams through the sync buffer); the
    caller must not touch its buffers until wait() returns (a size change is detected and fails
    the save; nothing is committed). replicated= and archive_check= as for save() (replicated
    buffers are hashed before the call returns).
    """
    called = time.monotonic()
    _previous_outcome()      # the previous save's unseen failure is its own, not logged as this one's
    made: dict[str, Any] = {}
    snaps: list[pools.Snapshot] = []

    def stage(sources: list[Source], opts: WriteOptions,
              io: config_mod.IoConfig) -> tuple[list[Source], pools.BlockPool, bool]:
        snap = pools.snapshot(sources, budget=options.pool_bytes("staging", io), block_size=opts.block_size,
                                ring_bytes=min(options.pool_bytes("sync", io), opts.threads * opts.block_size),
                                copy_threads=opts.copy_threads, timeout=opts.barrier_timeout)
        snaps.append(snap)
        return snap.sources, snap.pool, not snap.streaming     # staged: the writers start in the background

    try:
        s, cfg = _begin(state, epoch=epoch, step=step, name=name, root=root, model=model, config=config, rank=rank,
                        world_size=world_size, group=group, save_id=save_id, options=_require_options(options),
                        pool_kind="sync", progress=progress, replicated=replicated, archive_check=archive_check,
                        stage=None if zero_copy else stage, made=made)
        # Staged copies are written in the background; a state beyond the budget streams from the caller's thread.
        fut = writer.run_async(s, zero_copy or not snaps[0].streaming)
    except BaseException as e:
        for snap in snaps:
            snap.close()
        _failed("async_save", *_known(made, model, name), called, e)
        raise
    blocked = time.monotonic() - called
    if snaps:
        fut.add_done_callback(lambda f: snaps[0].close())

    def done(f: Future[SaveResult]) -> None:
        # In the background thread (a record is a file write: not in the caller's blocked time).
        if s.comm.rank == 0:
            records.record(s.root, s.model, records.ASYNC_SAVE, {"name": s.cid.name, "blocked_seconds": blocked})
            log.debug("async save of %s snapshotted; the caller was blocked %.3fs", s.cid.name, blocked,
                      extra=fields("async_save", model=s.model, checkpoint=s.cid.name, duration_s=blocked,
                                   outcome="started", blocked_seconds=blocked))
        if f.cancelled():
            return
        e = f.exception()
        if e is None:
            _recorded(s, f.result(), cfg)
        else:
            _failed("save", s.model, s.cid.name, called, e)

    fut.add_done_callback(done)
    handle = SaveHandle(fut, s.cid.name)
    with _previous_lock:
        _previous[:] = [handle]
    return handle


def release_staging() -> int:
    """Free async_save's staging memory now (or when the save holding it ended); the bytes
    freed now. The next async_save maps what it needs again (a first-save cost)."""
    return pools.release_staging()


def latest(*, root: str | Path | None = None, model: str | None = None,
           config: config_mod.NodeConfig | None = None) -> commit.CheckpointInfo | None:
    """The newest committed checkpoint (by epoch, step); None if none.

    Directories are tried newest first by name; the first whose marker is valid and whose files
    have their listed sizes is it (older ones are not read; no index is parsed)."""
    cfg = _cfg(config, root, model)
    got = commit.latest_committed(cfg.root, cfg.model, cfg.naming)
    log.debug("newest committed checkpoint of %s: %s", cfg.model, got.name if got else "none",
              extra=fields("latest", model=cfg.model, checkpoint=got.name if got else None,
                           outcome="found" if got else "none"))
    return got


def load(name: str | None = None, *, root: str | Path | None = None, model: str | None = None,
         config: config_mod.NodeConfig | None = None, rank: int | None = None, into: Mapping[Any, Any] | None = None,
         verify_hash: bool = False, options: IoOptions = _DEFAULT,
         progress: Callable[[int], None] | None = None) -> dict[Any, Any]:
    """Read a committed checkpoint (default: the newest) into buffers: `into` ones, else new ones.

    Returns the state as saved: a flat dict of buffers, or the nested structure (dict, OrderedDict,
    list and tuple each come back as themselves; scalars as saved). `into` mirrors that structure
    (all of it or a part; a None leaf is allocated) and is filled in place. Entries saved with
    replicated= come back on every rank (read from the files of the rank that wrote them).

    Sizes are always checked; content hashes when verify_hash=True. Of `options`, threads,
    block_size and direct apply (the others are about saving).
    """
    called = time.monotonic()
    cfg = None
    try:
        cfg = _cfg(config, root, model)
        commit.require_root(cfg.root)
        if name is None:
            info = commit.latest_committed(cfg.root, cfg.model, cfg.naming)
            if info is None:
                raise IntegrityError(f"no committed checkpoint under {Path(cfg.root) / cfg.model}")
        else:
            require_name(name, cfg.naming)
            found = commit.find(cfg.root, cfg.model, name, cfg.naming)
            if found is None:
                raise UserError(f"checkpoint {name} not found under {Path(cfg.root) / cfg.model} "
                                "(tiered-ckpt list shows what is there)")
            info = found
        if rank is None:
            rank = detect().rank
        opts = _require_options(options).resolve(cfg.io)
        moved = [0]
        lock = threading.Lock()

        def counted(n: int) -> None:     # bytes read, for the load's record (one add per block, any thread)
            with lock:
                moved[0] += n
            if progress is not None:
                progress(n)

        got = reader.load(info, rank=rank, into=into, check_hash=verify_hash, threads=opts.threads,
                          block_size=opts.block_size, direct=opts.direct, progress=counted)
    except BaseException as e:
        _failed("load", cfg.model if cfg else model, name, called, e)
        raise
    seconds = time.monotonic() - called
    log.log(logging.INFO if rank == 0 else logging.DEBUG, "loaded %s: %d bytes in %.2fs%s", info.name, moved[0],
            seconds, " (hashes verified)" if verify_hash else "",
            extra=fields("load", model=cfg.model, checkpoint=info.name, duration_s=seconds, nbytes=moved[0],
                         rank=rank, verified=verify_hash))
    return got
