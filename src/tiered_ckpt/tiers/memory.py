"""The node-local memory tier on disk: where each rank's copies live, what is there, the budget.

A directory on tmpfs (memory.dir: /dev/shm or a sized tmpfs mount the node boot creates) holds

    <dir>/w<world>/r<rank>/<model>/<name>/          rank <rank>'s own copy of checkpoint <name>
    <dir>/peer/w<world>/r<rank>/<model>/<name>/     a replica of rank <rank>'s copy, held for another node

Each `<dir>/w<W>/r<R>` (and each peer one) is an ordinary checkpoint root: every copy is a
complete single-process checkpoint written with the toolkit's commit protocol (files under final
names, xxh3-128 hashes, COMMITTED.json last), so a killed training process loses nothing that was
committed here and a half-written copy is never taken for one (io/commit.py decides, as on Lustre).
The job's world size is part of the path: after a world-size change nothing here matches, and the
restore goes to Lustre, where DCP reshards (tiered_ckpt.memory_tier).

Torch-free: the DCP writing and the transfers between nodes are tiered_ckpt.memory_tier's and
tiered_ckpt.replica's.
"""
from __future__ import annotations

import errno
import json
import logging
import os
import stat
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from tiered_ckpt.config import MemoryConfig
from tiered_ckpt.errors import UserError
from tiered_ckpt.io import commit, fsafe
from tiered_ckpt.io.hashing import new_hasher
from tiered_ckpt.io.marker import MARKER
from tiered_ckpt.logs import fields

log = logging.getLogger(__name__)

OWN, PEER = "memory", "peer"
_CHUNK = 8 << 20


def own_root(dir: str | os.PathLike[str], world: int, rank: int) -> Path:
    return Path(dir) / f"w{world}" / f"r{rank}"


def peer_root(dir: str | os.PathLike[str], world: int, rank: int) -> Path:
    return Path(dir) / "peer" / f"w{world}" / f"r{rank}"


def ensure_root(root: Path, anchor: str | os.PathLike[str]) -> Path:
    """Create a copy root below memory.dir; memory.dir itself is created when its parent exists
    (/dev/shm on every Linux node; a dedicated tmpfs mount the node boot made)."""
    base = Path(anchor)
    if not base.is_dir():
        if base.parent.is_dir() and not os.path.lexists(base):
            try:
                base.mkdir(mode=0o700)
            except FileExistsError:
                pass
        if not base.is_dir():
            raise UserError(f"memory.dir {base} does not exist or is not a directory; create it (or mount a tmpfs "
                            "there) or set memory.dir to a tmpfs directory such as /dev/shm/tiered-ckpt")
    fd = fsafe.make_dirs(root, anchor=base)
    os.close(fd)
    return root


def committed(root: Path, model: str, naming: str) -> list[commit.CheckpointInfo]:
    """The committed copies under one copy root, oldest first (sizes checked, as on Lustre)."""
    return commit.committed(commit.scan(root, model, naming))


def held_replicas(dir: str | os.PathLike[str], world: int, model: str, naming: str) -> dict[int, list[str]]:
    """{source rank: names of its committed replicas this node holds} for world size `world`."""
    base = Path(dir) / "peer" / f"w{world}"
    out: dict[int, list[str]] = {}
    try:
        entries = sorted(os.scandir(base), key=lambda e: e.name)
    except OSError:
        return out
    for e in entries:
        if not (e.name.startswith("r") and e.name[1:].isdigit() and e.is_dir(follow_symlinks=False)):
            continue
        names = [c.name for c in committed(Path(e.path), model, naming)]
        if names:
            out[int(e.name[1:])] = names
    return out


def usage(dir: str | os.PathLike[str]) -> int:
    """Bytes of regular files under memory.dir (symlinks are neither followed nor counted)."""
    total = 0
    for top, _dirs, files in os.walk(dir, followlinks=False):
        for f in files:
            try:
                st = os.lstat(os.path.join(top, f))
            except OSError:
                continue
            if stat.S_ISREG(st.st_mode):
                total += st.st_size
    return total


def _copies(root: Path, model: str, naming: str) -> list[commit.CheckpointInfo]:
    """Every copy directory (committed or not), oldest first."""
    return commit.scan(root, model, naming)


def remove(info: commit.CheckpointInfo, root: Path, reason: str) -> None:
    """Delete one copy, marker first (io/commit.py), with one log record."""
    commit.remove_checkpoint(info.path, anchor=root)
    log.info("memory tier: removed %s (%s)", info.path, reason,
             extra=fields("memory evict", checkpoint=info.name, outcome="removed", reason=reason))


def trim(root: Path, model: str, naming: str, keep: int) -> None:
    """Keep the newest `keep` committed copies under `root`; drop older ones and uncommitted ones
    older than the newest committed (a save killed half-way)."""
    infos = _copies(root, model, naming)
    done = [i for i in infos if i.committed]
    keep_set = {i.name for i in done[-keep:]} if keep > 0 else set()
    newest = done[-1].id if done else None
    for i in infos:
        if i.name in keep_set:
            continue
        if i.committed or (newest is not None and i.id < newest):
            remove(i, root, f"memory.keep={keep}" if i.committed else "an unfinished copy older than the newest")


@dataclass(frozen=True)
class Room:
    """What make_room found: bytes in use after evicting, and what it evicted."""

    used: int
    evicted: tuple[str, ...]


def make_room(cfg: MemoryConfig, root: Path, model: str, naming: str, need: int, name: str) -> Room:
    """Before writing a `need`-byte copy of `name` under `root`: evict this rank's oldest copies
    beyond memory.keep - 1, then more (never the newest committed one) while the budget would be
    exceeded. If even that cannot make it fit, a UserError naming memory.budget_bytes, and nothing
    is evicted or written (the copies there stay restorable)."""
    infos = [i for i in _copies(root, model, naming) if i.name != name]
    done = [i for i in infos if i.committed]
    stale = [i for i in infos if not i.committed and done and i.id < done[-1].id]
    drop = list(stale) + done[:max(0, len(done) - max(0, cfg.keep - 1))]
    left = [i for i in done if i not in drop]
    assert cfg.dir is not None
    used = usage(cfg.dir)
    if cfg.budget_bytes:
        size = {i.name: _size(i) for i in infos}
        after = used - sum(size[i.name] for i in drop)
        while after + need > cfg.budget_bytes and len(left) > 1:
            i = left.pop(0)
            drop.append(i)
            after -= size[i.name]
        if after + need > cfg.budget_bytes:
            spare = max(0, cfg.budget_bytes - (after - sum(size[i.name] for i in left[:-1])))
            raise UserError(f"memory tier full: {name} needs {need} bytes on this node but memory.budget_bytes="
                            f"{cfg.budget_bytes} leaves at most {spare} free even after evicting every copy but the "
                            "newest; raise memory.budget_bytes (keep x 2 copies of a node's share: `make plan` sizes "
                            "it), lower memory.keep, or save with tier='lustre'; nothing was evicted or written")
    for i in drop:
        remove(i, root, "an unfinished copy older than the newest" if not i.committed else
               f"memory.keep={cfg.keep}" if i in done[:max(0, len(done) - max(0, cfg.keep - 1))] else
               f"memory.budget_bytes={cfg.budget_bytes}")
    return Room(usage(cfg.dir), tuple(i.name for i in drop))


def _size(info: commit.CheckpointInfo) -> int:
    total = 0
    try:
        with os.scandir(info.path) as it:
            for e in it:
                if e.is_file(follow_symlinks=False):
                    total += e.stat(follow_symlinks=False).st_size
    except OSError:
        pass
    return total


def hash_problems(info: commit.CheckpointInfo) -> list[str]:
    """Every listed file hashed against the marker (sizes were checked when `info` was made)."""
    m = info.manifest
    assert m is not None
    bad = []
    for f in m.files:
        if f.hash is None:
            continue
        h = new_hasher()
        try:
            fd = fsafe.open_file(info.path / f.path, anchor=info.path.parent.parent)
        except OSError as e:
            bad.append(f"{info.path / f.path}: {e.strerror or e}")
            continue
        try:
            while True:
                b = os.read(fd, _CHUNK)
                if not b:
                    break
                h.update(b)
        finally:
            os.close(fd)
        if h.hexdigest() != f.hash:
            bad.append(f"{info.path / f.path}: content hash {h.hexdigest()} does not match the marker's {f.hash}")
    return bad


def files_of(info: commit.CheckpointInfo) -> list[str]:
    """The relative paths of one committed copy: every listed file, then the marker (sent last)."""
    assert info.manifest is not None
    return [f.path for f in info.manifest.files] + [MARKER]


def write_copy(root: Path, anchor: str | os.PathLike[str], model: str, name: str,
               files: Iterable[tuple[str, Iterable[bytes]]]) -> Path:
    """Write a copy arriving as (relative path, chunks) pairs, the marker last (as it is sent):
    files under their final names, each fsynced, then the marker and the directory fsynced.
    An earlier partial copy of `name` is removed first (marker first)."""
    ensure_root(root, anchor)
    d = root / model / name
    if os.path.lexists(d):
        commit.remove_checkpoint(d, anchor=root)
    fd = fsafe.make_dirs(d, anchor=root)
    try:
        for rel, chunks in files:
            if "/" in rel or rel in ("", ".", ".."):
                raise UserError(f"memory replica: refusing file name {rel!r} for {d}")
            try:
                out = os.open(rel, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | getattr(os, "O_NOFOLLOW", 0),
                              fsafe.FILE_MODE, dir_fd=fd)
            except OSError as e:
                if e.errno == errno.EEXIST:
                    raise UserError(f"memory replica: {d / rel} arrived twice; nothing was committed") from None
                raise
            try:
                for c in chunks:
                    fsafe.write_all(out, c)
                os.fsync(out)
            finally:
                os.close(out)
        os.fsync(fd)
    finally:
        os.close(fd)
    return d


# -- what the node's memory tier holds and has done, for metrics and status ---------------------

STATS_DIR = ".stats"
# Counters each rank's process keeps (tiered_ckpt.memory_tier.stats); summed over the node's ranks.
COUNTERS = ("saves", "replicas", "replica_failures", "persists", "persist_failures", "flushes", "restores",
            "fallbacks")


def write_stats(dir: str | os.PathLike[str], rank: int, stats: dict[str, float]) -> None:
    """This rank's counters as <dir>/.stats/r<rank>.json (atomic replace; best effort)."""
    d = Path(dir) / STATS_DIR
    try:
        d.mkdir(exist_ok=True)
        tmp = d / f".r{rank}.{os.getpid()}.tmp"
        tmp.write_text(json.dumps({**stats, "time_unix": time.time()}, sort_keys=True))
        os.replace(tmp, d / f"r{rank}.json")
    except OSError as e:
        log.debug("memory tier: could not write its counters under %s: %s", d, e)


@dataclass(frozen=True)
class Summary:
    """One node's memory tier: bytes held, copies, the newest step, the ranks' counters."""

    dir: str
    used_bytes: int
    budget_bytes: int
    own: int                       # committed own copies (all ranks of this node)
    peer: int                      # committed replicas held for other nodes
    newest_step: int | None
    newest: str | None
    counters: dict[str, float]
    replica_lag_seconds: float | None


def summary(cfg: MemoryConfig, model: str, naming: str) -> Summary | None:
    """None when the memory tier is off (memory.dir unset) or its directory is absent."""
    if not cfg.dir or not Path(cfg.dir).is_dir():
        return None
    own = peer = 0
    newest: commit.CheckpointInfo | None = None
    for wdir in sorted(Path(cfg.dir).glob("w*")):
        for rdir in sorted(wdir.glob("r*")):
            got = committed(rdir, model, naming)
            own += len(got)
            if got and (newest is None or got[-1].id > newest.id):
                newest = got[-1]
    for wdir in sorted((Path(cfg.dir) / "peer").glob("w*")):
        for rdir in sorted(wdir.glob("r*")):
            peer += len(committed(rdir, model, naming))
    counters = dict.fromkeys(COUNTERS, 0.0)
    lag: float | None = None
    for f in sorted((Path(cfg.dir) / STATS_DIR).glob("r*.json")):
        try:
            d = json.loads(f.read_text())
        except (OSError, ValueError):
            continue
        if not isinstance(d, dict):
            continue
        for k in COUNTERS:
            if isinstance(d.get(k), (int, float)):
                counters[k] += float(d[k])
        v = d.get("replica_lag_seconds")
        if isinstance(v, (int, float)) and d.get("replicas"):
            lag = max(lag or 0.0, float(v))
    return Summary(cfg.dir, usage(cfg.dir), cfg.budget_bytes, own, peer,
                   newest.id.step if newest else None, newest.name if newest else None, counters, lag)
