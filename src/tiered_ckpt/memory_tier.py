"""The memory tier for training: save to node RAM, replicate to a peer, persist, restore in tier order.

    save_training(model, optim, step=s, tier="memory")    # node RAM (+ peer replica, + AMLFS every N)
    state = load_training(model, optim)                   # memory -> peer -> lustre -> archive
    state.tier                                            # where this rank's state came from

Save (every rank): its DCP state goes, as a single-process DCP checkpoint written by
TieredWriter (the commit protocol: final names, hashes, marker last), into this node's memory
directory (tiers/memory.py lays it out); the ranks then agree that every one committed. In a
background thread, on the toolkit's own gloo group: each rank sends its copy to its peer
(replica.py: same local rank on the node `memory.peer_distance` further round the ring), and
every `memory.persist_every`-th save (or persist=True, or after a preemption notice) is persisted
to the checkpoint root from the memory copies, without touching the GPU: each rank copies the
files the global checkpoint needs (hash-checked against its memory marker) and rank 0 writes
DCP's global metadata (composed from the ranks' own) and the marker through TieredWriter, so
the result is an ordinary, reshardable checkpoint that AMLFS exports as today.

Restore: the ranks exchange what each holds (own copies, replicas held for others, and the
newest committed checkpoint on the root) and pick the newest step that *every* rank can get from
memory; each rank takes its own copy, else pulls its replica from the node holding it; every
byte is hashed before DCP loads it. A mismatch or a failed transfer is one WARNING record, and
the ranks agree to try the next source (own -> peer -> the previous step), else the root
(tiered_ckpt.training's load: Lustre, then the archive). A newer committed checkpoint on the
root wins over an older memory one. After a world-size change no memory copy matches (the world
size is in the layout) and the load reshards from the root through DCP.
"""
from __future__ import annotations

import functools
import logging
import os
import signal
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, TensorStorageMetadata
from torch.distributed.checkpoint.planner import SavePlan
from torch.distributed.checkpoint.storage import WriteResult

from tiered_ckpt import config as config_mod
from tiered_ckpt import records, replica
from tiered_ckpt.dcp import _FILES_FQN, TieredReader, TieredWriter
from tiered_ckpt.distributed import Comm
from tiered_ckpt.errors import IntegrityError, UserError
from tiered_ckpt.io import commit, fsafe
from tiered_ckpt.io.hashing import new_hasher
from tiered_ckpt.io.marker import FileEntry
from tiered_ckpt.io.options import IoOptions
from tiered_ckpt.logs import fields
from tiered_ckpt.naming import CheckpointId, parse_in
from tiered_ckpt.tiers import memory as tm

log = logging.getLogger(__name__)

MEMORY, PEER, LUSTRE, ARCHIVE = "memory", "peer", "lustre", "archive"
_MEM_IO = IoOptions(direct=False)      # tmpfs has no O_DIRECT; parallel writers still scale with memory bandwidth


def require_dir(cfg: config_mod.NodeConfig) -> str:
    if not cfg.memory.dir:
        raise UserError("the memory tier is off: set memory.dir in the node config (a tmpfs directory such as "
                        "/dev/shm/tiered-ckpt; the node boot mounts it), or save with tier='lustre'")
    return cfg.memory.dir


def _rank_world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _comm(cfg: config_mod.NodeConfig, purpose: str) -> Comm:
    rank, world = _rank_world()
    if world == 1:
        return Comm(0, 1)
    return Comm(rank, world, replica.group(purpose, cfg.memory.timeout), dist, cfg.memory.timeout)


def _nbytes(obj: Any) -> int:
    if isinstance(obj, torch.Tensor):
        t = obj.to_local() if hasattr(obj, "to_local") else obj
        return int(t.numel() * t.element_size())
    if isinstance(obj, (bytes, bytearray, memoryview)):
        return len(obj)
    if isinstance(obj, Mapping):
        return sum(_nbytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(_nbytes(v) for v in obj)
    return 64


# -- the background work (one at a time per process) -------------------------------------------

@dataclass
class _Job:
    thread: threading.Thread
    name: str
    error: BaseException | None = None


_job: list[_Job] = []
_state: dict[str, Any] = {"saves": 0, "last": None, "persisted": set(), "noticed": False}
stats: dict[str, float] = {"saves": 0, "replicas": 0, "replica_failures": 0, "replica_lag_seconds": 0.0,
                           "persists": 0, "persist_failures": 0, "flushes": 0, "restores": 0, "fallbacks": 0}


def wait_background(timeout: float | None = None) -> BaseException | None:
    """Wait for this process's replica/persist work to end; its error (already logged), if any."""
    if not _job:
        return None
    j = _job[0]
    j.thread.join(timeout)
    if j.thread.is_alive():
        return None
    _job.clear()
    return j.error


def save(state: dict[str, Any], cfg: config_mod.NodeConfig, cid: CheckpointId, *,
         persist: bool | None = None, background: bool = True) -> Path:
    """Every rank: write its state into this node's memory tier and agree that all committed;
    then replicate (and maybe persist) in the background. Returns this rank's copy's path."""
    mdir = require_dir(cfg)
    rank, world = _rank_world()
    wait_background()       # the previous save's replica and persistence end first (bounded memory)
    agree = _comm(cfg, "agree")
    copy = _comm(cfg, "copy")       # made here (a collective), used by the background thread
    root = tm.own_root(mdir, world, rank)
    t0 = time.monotonic()

    def write() -> bool:
        tm.ensure_root(root, mdir)
        tm.make_room(cfg.memory, root, cfg.model, cfg.naming, _nbytes(state), cid.name)
        # The archive is asked when the copy is persisted to the root (persist below), not for node RAM:
        # a memory save never waits on, or fails with, Blob.
        w = TieredWriter(root, cfg.model, name=cid.name, config=replace(cfg, archive=config_mod.ArchiveConfig()),
                         options=_MEM_IO)
        dcp.save(state, storage_writer=w, no_dist=True)
        return Path(cfg.memory.notice_file).exists() or bool(_state["noticed"])

    noticed = any(agree.phase("saving to the memory tier", cid.name, write))
    _state["saves"] += 1
    _state["last"] = (cfg, cid.name)
    stats["saves"] += 1
    every = cfg.memory.persist_every
    do_persist = persist if persist is not None else (_state["saves"] - 1) % every == 0
    if noticed:
        do_persist = True
        log.warning("memory tier: a preemption notice (%s) was seen; persisting %s to %s now",
                    cfg.memory.notice_file, cid.name, cfg.root,
                    extra=fields("memory flush", model=cfg.model, checkpoint=cid.name, outcome="started"))
    log.log(logging.INFO if rank == 0 else logging.DEBUG, "memory tier: committed %s on every rank in %.3fs",
            cid.name, time.monotonic() - t0,
            extra=fields("memory save", model=cfg.model, checkpoint=cid.name, duration_s=time.monotonic() - t0,
                         rank=rank, world_size=world))
    committed_at = time.monotonic()
    committed_unix, save_seconds = time.time(), committed_at - t0

    def failed(what: str, e: BaseException) -> None:
        j.error = j.error or e
        log.error("memory tier: %s of %s failed: %s", what, cid.name, e,
                  extra=fields(f"memory {what}", model=cfg.model, checkpoint=cid.name, outcome="error",
                               error=type(e).__name__))

    def work() -> None:
        # A failed replica or persist never stops training: logged, counted, and the next save's
        # caller learns of it from wait_background(). Every rank runs both steps whatever failed
        # (the persist's phases are collectives).
        replica_seconds: float | None = None
        persisted = False
        try:
            if cfg.memory.peer_distance and world > 1:
                try:
                    _replicate(cfg, cid.name, copy, committed_at)
                    replica_seconds = time.monotonic() - committed_at
                except BaseException as e:  # noqa: BLE001 - see above
                    failed("replica", e)
            if do_persist:
                try:
                    persist_now(cfg, cid.name, copy)    # False: on the root already; persisted either way
                    persisted = True
                    if noticed:
                        stats["flushes"] += 1
                except BaseException as e:  # noqa: BLE001 - see above
                    stats["persist_failures"] += 1
                    failed("persist", e)
        finally:
            tm.write_stats(mdir, rank, stats)
            # The timeline's memory lane (lifecycle/timeline.py): rank 0 records the save off the
            # caller's path, and only on a root that is there (never creating one).
            if rank == 0 and Path(cfg.root).is_dir():
                records.record(cfg.root, cfg.model, records.MEMORY, {
                    "name": cid.name, "seconds": save_seconds, "committed_unix": committed_unix,
                    "world_size": world, "replica_seconds": replica_seconds, "persisted": persisted})

    j = _Job(threading.Thread(target=work, daemon=True, name="tiered-ckpt-memory"), cid.name)
    _job[:] = [j]
    j.thread.start()
    if not background:
        j.thread.join()
        if j.error is not None:
            raise j.error
    return root / cfg.model / cid.name


def _replicate(cfg: config_mod.NodeConfig, name: str, comm: Comm, committed_at: float) -> None:
    """Ring: send this rank's copy to its peer while receiving the one this rank holds."""
    mdir = require_dir(cfg)
    rank, world = comm.rank, comm.world_size
    dst = replica.peer_of(rank, world, cfg.memory.peer_distance)
    src = replica.source_of(rank, world, cfg.memory.peer_distance)
    if dst is None or src is None:
        return
    info = commit.find(tm.own_root(mdir, world, rank), cfg.model, name, cfg.naming)
    sender = replica.Sender(info if info is not None and info.committed else None, dst, comm.group)
    sender.start()
    proot = tm.peer_root(mdir, world, src)
    problem = None
    try:
        got, files = replica.recv_copy(src, comm.group)
        if got:
            tm.trim(proot, cfg.model, cfg.naming, max(0, cfg.memory.keep - 1))
            d = tm.write_copy(proot, mdir, cfg.model, got, files)
            cid = parse_in(got, cfg.naming)
            ri = commit.inspect(cfg.model, d, cid, anchor=proot) if cid is not None else None
            if ri is None or not ri.committed:
                problem = f"the replica of rank {src}'s {got} is not complete ({ri.why_not_committed if ri else 'bad name'})"
            else:
                bad = tm.hash_problems(ri)
                if bad:
                    problem = bad[0]
            if problem is not None:
                commit.remove_checkpoint(d, anchor=proot)
        else:
            problem = f"rank {src} had no committed copy of {name} to replicate"
    except BaseException as e:  # noqa: BLE001 - reported below
        problem = f"receiving rank {src}'s replica of {name} failed: {e}"
    sender.join(cfg.memory.timeout)
    if sender.error is not None and problem is None:
        problem = f"sending {name} to rank {dst} failed: {sender.error}"
    if problem is not None:
        stats["replica_failures"] += 1
        raise UserError(f"memory replica: {problem}; the checkpoint stays committed in this node's memory "
                        "(and on the root once persisted)")
    stats["replicas"] += 1
    stats["replica_lag_seconds"] = time.monotonic() - committed_at
    log.debug("memory tier: replica of %s exchanged (sent %d bytes to rank %d, holding rank %d's)", name,
              sender.sent, dst, src,
              extra=fields("memory replica", model=cfg.model, checkpoint=name, nbytes=sender.sent,
                           duration_s=stats["replica_lag_seconds"], peer=dst, source=src))


# -- persistence to the checkpoint root ---------------------------------------------------------

@dataclass
class _Composed:
    metadata: Metadata
    results: list[list[WriteResult]]      # per rank: its chosen items (storage_data: where they are)
    needed: list[list[str]]               # per rank: the files of its memory copy the root needs


def _compose(parts: list[tuple[Metadata, list[tuple[str, int, str | None]]]]) -> _Composed:
    """DCP's global metadata from every rank's single-process one: each tensor chunk (and each
    non-tensor item) taken from the lowest rank that holds it (replicated ones are identical)."""
    sdm: dict[str, Any] = {}
    chosen: dict[MetadataIndex, int] = {}
    results: list[list[WriteResult]] = [[] for _ in parts]
    needed: list[set[str]] = [set() for _ in parts]
    planner: dict[str, Any] = {}
    for r, (md, _files) in enumerate(parts):
        if isinstance(md.planner_data, dict):
            for k, v in md.planner_data.items():
                planner.setdefault(k, v)
        for fqn, m in md.state_dict_metadata.items():
            if isinstance(m, TensorStorageMetadata):
                if fqn not in sdm:
                    sdm[fqn] = TensorStorageMetadata(m.properties, m.size, [])
                idxs: list[tuple[MetadataIndex, Any]] = [(MetadataIndex(fqn, c.offsets), c) for c in m.chunks]
            else:
                if fqn in sdm:
                    continue
                sdm[fqn] = m
                idxs = [(MetadataIndex(fqn), None)]
            for idx, chunk in idxs:
                if idx in chosen:
                    continue
                stored = md.storage_data.get(idx)
                if stored is None:
                    raise IntegrityError(f"rank {r}'s memory copy has no location for {fqn!r}; not persisted")
                chosen[idx] = r
                if chunk is not None:
                    sdm[fqn].chunks.append(chunk)
                results[r].append(WriteResult(index=idx, size_in_bytes=stored.length, storage_data=stored))
                needed[r].add(stored.relative_path)
    md0 = parts[0][0]
    # storage_meta named rank 0's memory copy (its path and save id): the root's copy is its own.
    meta = replace(md0, state_dict_metadata=sdm, planner_data=planner, storage_data=None, storage_meta=None)
    return _Composed(meta, results, [sorted(n) for n in needed])


def _copy_file(src: Path, src_anchor: Path, dst_dir: Path, dst_anchor: Path, rel: str,
               entry: FileEntry) -> FileEntry:
    """One memory file into the root's checkpoint directory, hashed on the way (a memory byte
    that changed since its commit is never persisted)."""
    h = new_hasher()
    ifd = fsafe.open_file(src / rel, anchor=src_anchor)
    try:
        dfd = fsafe.open_dir(dst_dir, anchor=dst_anchor)
        try:
            ofd = os.open(rel, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC | getattr(os, "O_NOFOLLOW", 0),
                          fsafe.FILE_MODE, dir_fd=dfd)
            try:
                n = 0
                while True:
                    b = os.read(ifd, 16 << 20)
                    if not b:
                        break
                    h.update(b)
                    fsafe.write_all(ofd, b)
                    n += len(b)
                os.fsync(ofd)
            finally:
                os.close(ofd)
        finally:
            os.close(dfd)
    finally:
        os.close(ifd)
    got = h.hexdigest()
    if n != entry.size or (entry.hash is not None and got != entry.hash):
        raise IntegrityError(f"{src / rel}: {n} bytes hashing to {got}, but its memory marker lists {entry.size} "
                             f"bytes hashing to {entry.hash}; the memory copy is damaged and was not persisted")
    return FileEntry(rel, n, got, 0)


def persist_now(cfg: config_mod.NodeConfig, name: str, comm: Comm) -> bool:
    """Every rank: make memory checkpoint `name` a committed checkpoint on the root (False when
    it already is one). Collective on `comm`; raises on every rank if any rank fails."""
    mdir = require_dir(cfg)
    rank, world = comm.rank, comm.world_size
    own = tm.own_root(mdir, world, rank)
    t0 = time.monotonic()

    def read() -> tuple[Any, ...]:
        info = commit.find(own, cfg.model, name, cfg.naming)
        if info is None or info.manifest is None:
            raise IntegrityError(f"rank {rank} has no committed memory copy of {name} to persist "
                                 f"({info.why_not_committed if info else 'none under ' + str(own)})")
        md = TieredReader(own, cfg.model, name=name, config=cfg).read_metadata()
        done = False
        if rank == 0:
            lus = commit.find(cfg.root, cfg.model, name, cfg.naming) if Path(cfg.root).is_dir() else None
            done = lus is not None and lus.committed
        return md, [(f.path, f.size, f.hash) for f in info.manifest.files], done

    parts = comm.phase("persisting", name, read)
    if parts[0][2]:
        _state["persisted"].add(name)
        return False
    plan = _compose([(p[0], p[1]) for p in parts])
    writer: list[TieredWriter] = []

    def claim() -> None:
        if rank == 0:
            w = TieredWriter(cfg.root, cfg.model, name=name, config=cfg)
            w.set_up_storage_writer(True, rank=0)
            w.prepare_global_plan([SavePlan([]) for _ in range(world)])
            writer.append(w)

    def release(_: BaseException) -> None:
        for w in writer:
            w.close()

    comm.phase("persisting", name, claim, release)
    entries = {p: FileEntry(p, s, h, 0) for p, s, h in parts[rank][1]}
    dst = Path(cfg.root) / cfg.model / name

    def copy() -> list[FileEntry]:
        out = []
        for rel in plan.needed[rank]:
            e = _copy_file(own / cfg.model / name, own, dst, Path(cfg.root), rel, entries[rel])
            out.append(replace(e, rank=rank))
        return out

    copied = comm.phase("persisting", name, copy, release)

    def finish() -> None:
        if rank == 0:
            results = [res + [WriteResult(index=MetadataIndex(_FILES_FQN), size_in_bytes=0, storage_data=files)]
                       for res, files in zip(plan.results, copied, strict=True)]
            writer[0].finish(plan.metadata, results)

    comm.phase("persisting", name, finish, release)
    _state["persisted"].add(name)
    stats["persists"] += 1
    log.log(logging.INFO if rank == 0 else logging.DEBUG, "memory tier: persisted %s to %s in %.2fs", name,
            cfg.root, time.monotonic() - t0,
            extra=fields("memory persist", model=cfg.model, checkpoint=name, duration_s=time.monotonic() - t0))
    return True


# -- emergency flush ------------------------------------------------------------------------------

def flush(cfg: config_mod.NodeConfig | None = None) -> str | None:
    """Every rank: persist the newest memory checkpoint not yet on the root (SIGTERM, a
    preemption notice, or the caller's own wish); its name, or None when there was none to persist."""
    got = _state["last"]
    if got is None:
        return None
    last_cfg, name = got
    cfg = cfg or last_cfg
    wait_background()
    if name in _state["persisted"]:
        return None
    comm = _comm(cfg, "copy")
    t0 = time.monotonic()
    done = persist_now(cfg, name, comm)
    if done:
        stats["flushes"] += 1
        tm.write_stats(require_dir(cfg), comm.rank, stats)
        log.warning("memory tier: emergency flush persisted %s to %s in %.2fs", name, cfg.root, time.monotonic() - t0,
                    extra=fields("memory flush", model=cfg.model, checkpoint=name, duration_s=time.monotonic() - t0))
    return name if done else None


_installed: dict[str, Any] = {}


def install_emergency_flush(cfg: config_mod.NodeConfig | None = None, *, poll: float = 1.0,
                            exit_code: int = 143) -> None:
    """On SIGTERM (Slurm's, torchrun's), flush then exit; when memory.notice_file appears (the
    Scheduled Events watcher writes it on a Preempt/Terminate/Reboot notice), the next memory
    save persists at once. Call once, from the main thread, after init_process_group."""
    if _installed:
        return

    def on_term(signum: int, frame: Any) -> None:
        try:
            flush(cfg)
        except BaseException as e:  # noqa: BLE001 - the process is going anyway; say what was lost
            log.error("memory tier: emergency flush failed: %s", e,
                      extra=fields("memory flush", outcome="error", error=type(e).__name__))
        raise SystemExit(exit_code)

    _installed["term"] = signal.signal(signal.SIGTERM, on_term)
    notice = (cfg or config_mod.load()).memory.notice_file

    def watch() -> None:
        while not _state["noticed"]:
            if os.path.exists(notice):
                _state["noticed"] = True
                log.warning("memory tier: preemption notice %s: the next memory save persists to the root", notice,
                            extra=fields("memory notice", outcome="noticed"))
                return
            time.sleep(poll)

    t = threading.Thread(target=watch, daemon=True, name="tiered-ckpt-notice")
    _installed["watch"] = t
    t.start()


# -- restore --------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Restored:
    name: str
    tier: str          # memory or peer
    path: Path


def _view(cfg: config_mod.NodeConfig, mdir: str, rank: int, world: int,
          drop_own: set[str], drop_held: set[tuple[int, str]]) -> dict[str, Any]:
    own = [i.name for i in tm.committed(tm.own_root(mdir, world, rank), cfg.model, cfg.naming) if i.name not in drop_own]
    held = {src: [n for n in names if (src, n) not in drop_held]
            for src, names in tm.held_replicas(mdir, world, cfg.model, cfg.naming).items()}
    root_latest = None
    if rank == 0 and Path(cfg.root).is_dir():
        info = commit.latest_committed(cfg.root, cfg.model, cfg.naming)
        root_latest = info.name if info is not None else None
    return {"own": own, "held": held, "root": root_latest}


def restore(cfg: config_mod.NodeConfig, load: Callable[[Path, str], Any]) -> tuple[Restored, Any] | None:
    """Every rank: load the newest step every rank can get from memory (own copy, else the peer's
    replica); None when the root holds a newer one or memory has none for this world size (the
    caller then loads from the root). `load(root, name)` loads one verified copy into the state."""
    mdir = require_dir(cfg)
    rank, world = _rank_world()
    comm = _comm(cfg, "agree")
    drop_own: set[str] = set()
    drop_held: set[tuple[int, str]] = set()
    def cid_of(n: str) -> CheckpointId:
        cid = parse_in(n, cfg.naming)
        assert cid is not None      # only names parse_in read are ever listed
        return cid

    while True:
        views = comm.phase("restoring", "the memory tier",
                           lambda: _view(cfg, mdir, rank, world, drop_own, drop_held))
        sources: list[dict[str, int | None]] = []
        for r in range(world):
            s: dict[str, int | None] = {n: None for n in views[r]["own"]}
            for h in range(world):
                if h != r and not replica.same_node(h, r, world):
                    for n in views[h]["held"].get(r, []):
                        s.setdefault(n, h)
            sources.append(s)
        common = set(sources[0])
        for s in sources[1:]:
            common &= set(s)
        best = max(common, key=lambda n: cid_of(n)) if common else None
        on_root = views[0]["root"]
        if best is None or (on_root is not None and cid_of(on_root) > cid_of(best)):
            why = "no step every rank holds" if best is None else f"the root holds a newer {on_root}"
            log.log(logging.INFO if rank == 0 else logging.DEBUG, "memory tier: not restoring from memory (%s)", why,
                    extra=fields("memory restore", model=cfg.model, outcome="skipped", reason=why))
            return None
        holders = [sources[r][best] for r in range(world)]
        own = tm.own_root(mdir, world, rank)
        problem: str | None = None
        refused = False          # the holder found its replica damaged and said so in its own record
        # Pulls in rank order; each pair only blocks its two ranks, every rank walks the same order.
        for r, holder in enumerate(holders):
            if holder is None:
                continue
            h = holder
            if rank == h:
                info = commit.find(tm.peer_root(mdir, world, r), cfg.model, best, cfg.naming)
                bad = tm.hash_problems(info) if info is not None and info.committed else ["replica not committed"]
                if bad:
                    log.warning("memory tier: the replica of rank %d's %s failed verification (%s); rank %d falls back "
                                "to an older step or the root", r, best, bad[0], r,
                                extra=fields("memory restore", model=cfg.model, checkpoint=best, outcome="fallback",
                                             tier=PEER, rank=r, reason=bad[0]))
                    replica.Sender(None, r, comm.group).run()      # an empty header: "none to send"
                else:
                    assert info is not None
                    replica.send_copy(info, r, comm.group)
            elif rank == r:
                try:
                    got, files = replica.recv_copy(h, comm.group)
                    if got != best:
                        problem, refused = f"rank {h} could not send a sound replica of {best}", True
                    else:
                        tm.ensure_root(own, mdir)
                        tm.write_copy(own, mdir, cfg.model, best, files)
                except BaseException as e:  # noqa: BLE001 - agreed on below
                    problem = f"pulling {best} from rank {h} failed: {e}"
        path = own / cfg.model / best
        if problem is None:
            info = commit.inspect(cfg.model, path, cid_of(best), anchor=own)
            if not info.committed:
                problem = f"{path}: {info.why_not_committed or 'not committed'}"
            else:
                bad = tm.hash_problems(info)
                problem = bad[0] if bad else None
        tier = MEMORY if holders[rank] is None else PEER
        if problem is not None:
            stats["fallbacks"] += 1
            nxt = "the peer's replica" if tier == MEMORY else "an older step or the root"
            log.log(logging.INFO if refused else logging.WARNING, "memory tier: %s failed verification (%s); falling back to %s", best, problem, nxt,
                        extra=fields("memory restore", model=cfg.model, checkpoint=best, outcome="fallback",
                                     tier=tier, rank=rank, reason=problem))
            if os.path.lexists(path):
                commit.remove_checkpoint(path, anchor=own)
        outcomes = comm.exchange(problem)
        failed = [r for r, p in enumerate(outcomes) if p is not None]
        if failed:
            for r in failed:
                if holders[r] is None:
                    if r == rank:
                        drop_own.add(best)
                else:
                    if holders[r] == rank:
                        drop_held.add((r, best))
                    if r == rank:
                        drop_own.add(best)
            # Ranks whose own copy failed were dropped locally; the others learn it from the next view.
            continue
        t0 = time.monotonic()
        result = comm.phase("loading", best, functools.partial(load, own, best))
        stats["restores"] += 1
        tm.write_stats(mdir, rank, stats)
        log.log(logging.INFO if rank == 0 else logging.DEBUG, "memory tier: restored %s from %s in %.2fs", best, tier,
                time.monotonic() - t0,
                extra=fields("memory restore", model=cfg.model, checkpoint=best, outcome="restored", tier=tier,
                             rank=rank, duration_s=time.monotonic() - t0))
        return Restored(best, tier, path), result[rank]


def latest(cfg: config_mod.NodeConfig, rank: int = 0, world: int = 1) -> tuple[str, str] | None:
    """(name, tier) of the newest committed checkpoint this rank can see without the others:
    its own memory copy, a replica this node holds of it, or the root's. A memory-only
    checkpoint is never "no checkpoint"."""
    found: list[tuple[CheckpointId, str, str]] = []
    if cfg.memory.dir:
        for i in tm.committed(tm.own_root(cfg.memory.dir, world, rank), cfg.model, cfg.naming)[-1:]:
            found.append((i.id, i.name, MEMORY))
        for src, names in tm.held_replicas(cfg.memory.dir, world, cfg.model, cfg.naming).items():
            if src == rank and names:
                cid = parse_in(names[-1], cfg.naming)
                if cid is not None:
                    found.append((cid, names[-1], PEER))
    if Path(cfg.root).is_dir():
        info = commit.latest_committed(cfg.root, cfg.model, cfg.naming)
        if info is not None:
            found.append((info.id, info.name, LUSTRE))
    if not found:
        return None
    _, name, tier = max(found, key=lambda t: (t[0], t[2] == LUSTRE))
    return name, tier
