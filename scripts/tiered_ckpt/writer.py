"""The parallel checkpoint writer and the commit around it.

One rank's bytes are laid out as a concatenation of its buffers, cut into `files` shards of
equal size (a buffer may span shards; the index records every segment). A producer copies
the bytes into page-aligned pool blocks (see staging.py), round-robin over the shards being
written, and writer threads (one shard each at a time) hash every block inline (xxh3-128)
and write it with O_DIRECT; the last partial block is zero-padded, written, and the file
truncated to its true size. Every shard is fsynced, then the directory.

Commit, following manifest.py: each rank writes its part manifest (a file under its final
name, listed in the marker like any file, so AMLFS exports it too); after every rank is done
rank 0 writes COMMITTED.json naming every rank's files. No renames anywhere.

A directory of the same name without a valid marker is a save that never finished (a crash):
by default it is replaced (each rank removes its own stale files; rank 0 removes whatever the
manifest does not list before committing), because a restarted job naturally re-saves the
step it crashed in. Pass overwrite_incomplete=False to refuse instead. A committed checkpoint
is never overwritten (ConflictError).
"""
from __future__ import annotations

import bisect
import errno
import json
import os
import queue
import shutil
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from . import manifest as mf
from .buffers import Source
from .distributed import Comm
from .errors import ConflictError, IntegrityError, UserError
from .hashing import hash_path, new_hasher
from .naming import CheckpointId
from .staging import ALIGN, Aborted, BlockPool

SHARD = "shard-r{rank:05d}-{i:03d}.bin"
PART = "rank{rank:05d}.part.json"
FAILED = "rank{rank:05d}.failed.json"

Progress = Callable[[int], None]


@dataclass(frozen=True)
class WriteOptions:
    files: int = 8
    threads: int = 8
    block_size: int = 16 << 20
    direct: bool = True
    hash: bool = True
    barrier_timeout: float = 600.0
    copy_threads: int | None = None     # default: one per core, at most 8


@dataclass(frozen=True)
class Segment:
    source: int          # index into the rank's sources
    src_offset: int
    file_offset: int
    nbytes: int


@dataclass
class FilePlan:
    path: str
    size: int
    segments: list[Segment] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._starts: list[int] = []

    def locate(self, file_offset: int) -> int:
        if len(self._starts) != len(self.segments):
            self._starts = [s.file_offset for s in self.segments]
        return max(0, bisect.bisect_right(self._starts, file_offset) - 1)


def plan(sizes: Sequence[int], nfiles: int, rank: int) -> list[FilePlan]:
    """Cut the concatenation of the buffers into <= nfiles shards of equal, 4 KiB-aligned size."""
    total = sum(sizes)
    nfiles = max(1, min(nfiles, -(-total // ALIGN)))
    per_file = -(-total // nfiles)
    per = -(-per_file // ALIGN) * ALIGN if total else 0
    files = [FilePlan(SHARD.format(rank=rank, i=i), 0) for i in range(nfiles)]
    fi = 0
    for si, size in enumerate(sizes):
        done = 0
        while done < size:
            f = files[fi]
            if per and f.size >= per and fi < nfiles - 1:
                fi += 1
                continue
            take = size - done if fi == nfiles - 1 else min(size - done, per - f.size)
            f.segments.append(Segment(si, done, f.size, take))
            f.size += take
            done += take
    return files


class _Pipeline:
    """Writer threads for one rank's shards, fed block by block by a producer."""

    def __init__(self, ckpt_dir: Path, files: list[FilePlan], sources: list[Source], pool: BlockPool,
                 opts: WriteOptions, progress: Progress | None) -> None:
        self.dir, self.files, self.sources, self.pool, self.opts = ckpt_dir, files, sources, pool, opts
        self.progress = progress
        self.aborted = threading.Event()
        self.error: BaseException | None = None
        self._err_lock = threading.Lock()
        self._work: queue.Queue[int | None] = queue.Queue()
        self._chunks: list[queue.Queue[tuple[int, int, int]]] = [queue.Queue() for _ in files]
        self._sched_lock = threading.Lock()
        self._pending = deque(range(len(files)))
        self._active: list[list[int]] = []
        self._rr = 0
        # Copy threads: memmove releases the GIL, so several cores share the snapshot copy.
        self.ncopy = max(1, min(opts.copy_threads or (os.cpu_count() or 1), self.pool.nblocks // 2 or 1, 8))
        self.entries: list[mf.FileEntry | None] = [None] * len(files)
        self.direct_used = opts.direct
        self.nthreads = max(1, min(opts.threads, len(files)))
        self._threads = [threading.Thread(target=self._run, name=f"ckpt-writer-{i}", daemon=True) for i in range(self.nthreads)]
        self.rank = 0

    def start(self) -> None:
        for t in self._threads:
            t.start()

    def fail(self, exc: BaseException) -> None:
        with self._err_lock:
            if self.error is None:
                self.error = exc
        self.aborted.set()

    # -- producers: the caller's thread (plus helpers) for a snapshot, background threads for zero-copy --
    def produce(self) -> None:
        """Copy every byte into pool blocks; returns when the last byte is copied (or on failure)."""
        helpers = [threading.Thread(target=self._produce_guarded, name=f"ckpt-copy-{i}", daemon=True)
                   for i in range(self.ncopy - 1)]
        for t in helpers:
            t.start()
        self._produce_guarded()
        for t in helpers:
            t.join()
        try:
            if self.error is None:
                for s in self.sources:
                    why = s.changed()
                    if why:
                        raise IntegrityError(f"{why}; nothing was committed. Keep buffers unchanged until the save has "
                                             "snapshotted them (async) or finished (zero-copy, handle.wait())")
        except BaseException as e:
            self.fail(e)
        finally:
            for _ in self._threads:
                self._work.put(None)

    def _produce_guarded(self) -> None:
        try:
            self._produce()
        except Aborted:
            pass
        except BaseException as e:
            self.fail(e)

    def _next_task(self) -> tuple[int, int, int] | None:
        """The next block to copy, round-robin over the shards being written (at most one per writer)."""
        with self._sched_lock:
            while len(self._active) < self.nthreads and self._pending:
                fi = self._pending.popleft()
                self._work.put(fi)
                if self.files[fi].size:
                    self._active.append([fi, 0])
            if not self._active:
                return None
            self._rr %= len(self._active)
            st = self._active[self._rr]
            fi, off = st
            n = min(self.pool.block_size, self.files[fi].size - off)
            st[1] += n
            if st[1] >= self.files[fi].size:
                self._active.pop(self._rr)
            else:
                self._rr += 1
            return fi, off, n

    def _produce(self) -> None:
        while True:
            if self.aborted.is_set():
                raise Aborted()
            # The block first, then the task: a task handed out can always be completed (no deadlock
            # with a small pool and several copy threads).
            idx = self.pool.acquire(self.aborted)
            task = self._next_task()
            if task is None:
                self.pool.release(idx)
                return
            fi, off, n = task
            try:
                self._fill(idx, self.files[fi], off, n)
            except BaseException:
                self.pool.release(idx)
                raise
            self._chunks[fi].put((off, idx, n))

    def _fill(self, idx: int, fp: FilePlan, file_off: int, n: int) -> None:
        out, out_addr = self.pool.view(idx), self.pool.address(idx)
        si = fp.locate(file_off)
        pos = 0
        while pos < n:
            seg = fp.segments[si]
            into = file_off + pos - seg.file_offset
            take = min(seg.nbytes - into, n - pos)
            self.sources[seg.source].copy_into(seg.src_offset + into, out[pos:pos + take], out_addr + pos)
            pos += take
            si += 1

    # -- writers --
    def _run(self) -> None:
        with ThreadPoolExecutor(max_workers=1, thread_name_prefix="ckpt-hash") as hasher:
            while True:
                fi = self._work.get()
                if fi is None or self.aborted.is_set():
                    return
                try:
                    self.entries[fi] = self._write_file(fi, hasher)
                except Aborted:
                    return
                except BaseException as e:
                    self.fail(e)
                    return

    def _next_chunk(self, fi: int, off: int, held: dict[int, tuple[int, int]]) -> tuple[int, int]:
        """The block holding `off` of shard fi; copy threads may deliver blocks out of order."""
        q = self._chunks[fi]
        while off not in held:
            try:
                o, idx, n = q.get(timeout=0.05)
                held[o] = (idx, n)
            except queue.Empty:
                if self.aborted.is_set():
                    raise Aborted() from None
        return held.pop(off)

    def _write_file(self, fi: int, hasher: ThreadPoolExecutor) -> mf.FileEntry:
        fp = self.files[fi]
        path = self.dir / fp.path
        fd, direct = open_data(path, self.opts.direct)
        if not direct:
            self.direct_used = False
        held: dict[int, tuple[int, int]] = {}
        try:
            h = new_hasher() if self.opts.hash else None
            off = 0
            while off < fp.size:
                idx, n = self._next_chunk(fi, off, held)
                try:
                    view = self.pool.view(idx)
                    # Hash on a helper thread while this one writes the same block: xxh3 releases
                    # the GIL, so the hash costs no device time (blocks stay in order per shard).
                    hashed = hasher.submit(h.update, view[:n]) if h is not None else None
                    wlen = n
                    if direct and n % ALIGN:
                        wlen = -(-n // ALIGN) * ALIGN
                        view[n:wlen] = bytes(wlen - n)
                    try:
                        pwrite_all(fd, view[:wlen], off)
                    finally:
                        if hashed is not None:
                            hashed.result()
                finally:
                    self.pool.release(idx)
                off += n
                if self.progress is not None:
                    self.progress(n)
            if direct and fp.size % ALIGN:
                os.ftruncate(fd, fp.size)
            os.fsync(fd)
        except OSError as e:
            raise os_error(e, path) from None
        finally:
            os.close(fd)
            for idx, _ in held.values():
                self.pool.release(idx)
        return mf.FileEntry(fp.path, fp.size, h.hexdigest() if h is not None else None, self.rank)

    def finish(self) -> list[mf.FileEntry]:
        for t in self._threads:
            t.join()
        # Drain blocks left in queues by an abort, so the reusable pool stays whole.
        for q in self._chunks:
            while not q.empty():
                self.pool.release(q.get_nowait()[1])
        if self.error is not None:
            raise self.error
        return [e for e in self.entries if e is not None]


def open_data(path: Path, direct: bool) -> tuple[int, bool]:
    """Open a data file for writing under its final name; O_DIRECT where the file system allows it."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC
    if direct and hasattr(os, "O_DIRECT"):
        try:
            return os.open(path, flags | os.O_DIRECT, 0o644), True
        except OSError as e:
            if e.errno != errno.EINVAL:   # tmpfs and some FUSE mounts refuse O_DIRECT
                raise os_error(e, path) from None
    try:
        return os.open(path, flags, 0o644), False
    except OSError as e:
        raise os_error(e, path) from None


def pwrite_all(fd: int, view: memoryview, offset: int) -> None:
    while view:
        n = os.pwrite(fd, view, offset)
        if n <= 0:
            raise OSError(errno.EIO, "short write")
        view, offset = view[n:], offset + n


def os_error(e: OSError, path: str | os.PathLike[str]) -> UserError:
    p = Path(path)
    if e.errno in (errno.ENOSPC, errno.EDQUOT):
        return UserError(f"no space left writing {p} ({e.strerror}); free space on that file system "
                         "(tiered-ckpt retention) or choose another --root; the checkpoint was not committed")
    if e.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        return UserError(f"cannot write {p} ({e.strerror}); check the permissions or mount of {p.parent} "
                         "or choose another --root; the checkpoint was not committed")
    if e.errno == errno.EFBIG:
        return UserError(f"file too large writing {p} ({e.strerror}); raise the file size limit (ulimit -f) "
                         "or use more --files; the checkpoint was not committed")
    if e.errno in (errno.ENOENT, errno.ENOTDIR):
        return UserError(f"{p.parent} disappeared while writing ({e.strerror}); check the mount; the checkpoint was not committed")
    return UserError(f"writing {p} failed: {e.strerror or e} (errno {e.errno}); the checkpoint was not committed")


def write_small(path: Path, data: bytes) -> None:
    """A small file (part manifest, failure note) under its final name, fsynced."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)
    try:
        pwrite_all(fd, memoryview(data), 0)
        os.fsync(fd)
    finally:
        os.close(fd)


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


def _own_files(d: Path, rank: int) -> list[Path]:
    prefix = f"shard-r{rank:05d}-"
    out = []
    try:
        for e in os.scandir(d):
            if e.name.startswith(prefix) or e.name in (PART.format(rank=rank), FAILED.format(rank=rank)):
                out.append(Path(e.path))
    except FileNotFoundError:
        pass
    return out


class Save:
    """One save of one rank: prepare (caller's thread), produce, then finish and commit."""

    def __init__(self, root: Path, model: str, cid: CheckpointId, sources: list[Source], comm: Comm,
                 opts: WriteOptions, pool: BlockPool, *, overwrite_incomplete: bool = True,
                 save_id: str | None = None, progress: Progress | None = None) -> None:
        self.root, self.model, self.cid, self.sources, self.comm, self.opts = root, model, cid, sources, comm, opts
        self.pool, self.overwrite_incomplete, self.save_id, self.progress = pool, overwrite_incomplete, save_id, progress
        self.dir = root / model / cid.name
        self.t0 = time.perf_counter()
        self.pipeline: _Pipeline | None = None
        self.files: list[FilePlan] = []
        self.file_mode = comm.world_size > 1 and not comm.uses_torch
        if self.file_mode and not save_id:
            raise UserError(
                f"rank {comm.rank} of {comm.world_size} without torch.distributed: pass save_id= a string every rank "
                "shares for this save (e.g. job id + attempt), so files of a crashed earlier attempt are never committed"
            )

    # -- caller's thread --
    def prepare(self) -> None:
        err: UserError | None = None
        try:
            self._prepare_dir()
        except UserError as e:
            err = e
        except OSError as e:
            # Removing a stale attempt can fail too (permissions, a vanished mount): one clear
            # message, and under torch.distributed the other ranks learn of it instead of waiting.
            err = os_error(e, self.dir)
        self._agree(err, "preparing")
        self.files = plan([s.nbytes for s in self.sources], self.opts.files, self.comm.rank)
        self.pipeline = _Pipeline(self.dir, self.files, self.sources, self.pool, self.opts, self.progress)
        self.pipeline.rank = self.comm.rank
        self.pipeline.start()

    def _prepare_dir(self) -> None:
        mf.require_root(self.root)
        mdir = self.root / self.model
        try:
            mdir.mkdir(exist_ok=True)
            existed = self.dir.is_dir()
            self.dir.mkdir(exist_ok=True)
        except OSError as e:
            raise os_error(e, self.dir) from None
        if not os.access(self.dir, os.W_OK):
            raise UserError(f"cannot write to {self.dir}: permission denied; fix its permissions or choose another --root")
        marker = self.dir / mf.MARKER
        if marker.exists():
            m = mf.read_marker(self.dir)
            if m is not None:
                damaged = mf.size_problems(self.dir, m)
                raise ConflictError(
                    f"{self.dir} is already a committed checkpoint" + (" (with missing or resized files)" if damaged else "")
                    + "; committed checkpoints are never overwritten — save under another epoch/step, or delete it "
                    "first (tiered-ckpt retention)"
                )
        stale = _own_files(self.dir, self.comm.rank)
        torn = marker.exists()
        if self.comm.world_size == 1 and existed:
            stale = sorted(self.dir.iterdir())   # single writer: the whole unfinished directory is its own
        if (stale or torn) and not self.overwrite_incomplete:
            raise ConflictError(
                f"{self.dir} holds an earlier save of {self.cid.name} that never committed (no valid {mf.MARKER}); "
                "pass overwrite_incomplete=True to replace it, or remove the directory"
            )
        if torn and self.comm.rank == 0:
            marker.unlink()   # a torn marker (crash while writing it) would block the O_EXCL create
        for p in stale:
            if p.name != mf.MARKER:
                if p.is_dir() and not p.is_symlink():
                    shutil.rmtree(p)
                else:
                    p.unlink(missing_ok=True)
        if stale or torn:
            mf.fsync_dir(self.dir)

    def produce(self) -> None:
        assert self.pipeline is not None
        self.pipeline.produce()

    # -- any thread --
    def finish(self) -> SaveResult:
        assert self.pipeline is not None
        err: UserError | None = None
        entries: list[mf.FileEntry] = []
        try:
            entries = self.pipeline.finish()
            mf.fsync_dir(self.dir)
            self._write_part(entries)
        except UserError as e:
            err = e
        except OSError as e:
            err = os_error(e, self.dir)
        except Exception as e:
            # Still take part in the ranks' agreement below, so no other rank waits forever.
            err = UserError(f"rank {self.comm.rank} failed while writing {self.cid.name}: {e!r}")
            err.__cause__ = e
        except BaseException as e:
            self.abort(e)
            raise
        if err is not None:
            self._cleanup_own()
        self._agree(err, "writing")
        commit_err: UserError | None = None
        if self.comm.rank == 0:
            try:
                self._commit()
            except UserError as e:
                commit_err = e
            except OSError as e:
                commit_err = os_error(e, self.dir / mf.MARKER)
        self._agree_commit(commit_err)
        return SaveResult(self.cid.name, str(self.dir), sum(s.nbytes for s in self.sources), len(entries),
                          self.comm.rank, self.comm.world_size, time.perf_counter() - self.t0,
                          self.pipeline.direct_used, self.opts.hash)

    def abort(self, exc: BaseException) -> None:
        if self.pipeline is not None:
            self.pipeline.fail(exc)
            try:
                self.pipeline.finish()
            except BaseException:
                pass
        self._cleanup_own()
        if self.file_mode:
            self._note_failure(str(exc))

    def _cleanup_own(self) -> None:
        for p in _own_files(self.dir, self.comm.rank):
            p.unlink(missing_ok=True)
        if self.comm.world_size == 1:
            try:
                self.dir.rmdir()   # only if empty: never removes anything another writer put there
            except OSError:
                pass

    def _part_path(self, rank: int) -> Path:
        return self.dir / PART.format(rank=rank)

    def _write_part(self, entries: list[mf.FileEntry]) -> None:
        index: dict[str, Any] = {}
        by_source: dict[int, list[list[Any]]] = {}
        for fp in self.files:
            for seg in fp.segments:
                by_source.setdefault(seg.source, []).append([fp.path, seg.file_offset, seg.nbytes, seg.src_offset])
        for si, s in enumerate(self.sources):
            index[s.name] = {"kind": s.kind, "dtype": s.dtype, "shape": s.shape, "nbytes": s.nbytes,
                             "segments": by_source.get(si, [])}
        part = {"save_id": self.save_id, "rank": self.comm.rank, "world_size": self.comm.world_size,
                "checkpoint": self.cid.name, "files": [e.__dict__ for e in entries], "index": index}
        write_small(self._part_path(self.comm.rank), json.dumps(part, sort_keys=True).encode())
        mf.fsync_dir(self.dir)

    def _note_failure(self, message: str) -> None:
        try:
            write_small(self.dir / FAILED.format(rank=self.comm.rank),
                        json.dumps({"save_id": self.save_id, "error": message}).encode())
        except OSError:
            pass

    # -- agreement between ranks --
    def _agree(self, err: UserError | None, stage: str) -> None:
        """Every rank learns whether every rank got through `stage`; raises on any failure."""
        if self.comm.uses_torch and self.comm.world_size > 1:
            statuses = self.comm.exchange(None if err is None else str(err))
            bad = [(r, m) for r, m in enumerate(statuses) if m is not None]
            if err is not None:
                raise err
            if bad:
                raise UserError(f"rank {bad[0][0]} failed while {stage} {self.cid.name}: {bad[0][1]}; nothing was committed")
            return
        if err is not None:
            if self.file_mode:
                self._note_failure(str(err))
            raise err
        if self.file_mode and stage == "writing" and self.comm.rank == 0:
            try:
                self._wait_for_parts()
            except UserError as e:
                self._note_failure(str(e))
                raise

    def _wait_for_parts(self) -> None:
        deadline = time.monotonic() + self.opts.barrier_timeout
        missing = set(range(1, self.comm.world_size))
        while missing:
            for r in sorted(missing):
                failed = _read_json(self.dir / FAILED.format(rank=r))
                if failed is not None and failed.get("save_id") == self.save_id:
                    raise UserError(f"rank {r} failed while writing {self.cid.name}: {failed.get('error')}; nothing was committed")
                part = _read_json(self._part_path(r))
                if part is not None and part.get("save_id") == self.save_id:
                    missing.discard(r)
            if missing and time.monotonic() > deadline:
                raise UserError(
                    f"rank(s) {sorted(missing)} did not finish writing {self.cid.name} within {self.opts.barrier_timeout:.0f} s "
                    f"(no {PART.format(rank=min(missing))} with save_id {self.save_id!r}); nothing was committed"
                )
            if missing:
                time.sleep(0.02)

    def _commit(self) -> None:
        parts = []
        for r in range(self.comm.world_size):
            part = _read_json(self._part_path(r))
            if part is None or part.get("save_id") != self.save_id:
                raise IntegrityError(f"part manifest of rank {r} ({self._part_path(r)}) is missing or stale; nothing was committed")
            parts.append(part)
        files: list[mf.FileEntry] = []
        for r, part in enumerate(parts):
            files += [mf.FileEntry(**f) for f in part["files"]]
            pp = self._part_path(r)
            files.append(mf.FileEntry(pp.name, pp.stat().st_size, hash_path(str(pp)), r))
        index = {"save_id": self.save_id, "ranks": {str(r): p["index"] for r, p in enumerate(parts)}}
        m = mf.Manifest(epoch=self.cid.epoch, step=self.cid.step, files=files, world_size=self.comm.world_size, index=index)
        listed = {f.path for f in files}
        removed = False
        for e in os.scandir(self.dir):
            if e.name not in listed and e.name != mf.MARKER and e.is_file(follow_symlinks=False):
                os.unlink(e.path)   # left by a crashed earlier attempt (e.g. a larger world size)
                removed = True
        if removed:
            mf.fsync_dir(self.dir)
        problems = mf.size_problems(self.dir, m)
        if problems:
            raise IntegrityError(f"{self.cid.name} not committed: " + "; ".join(problems))
        mf.write_marker(self.dir, m)

    def _agree_commit(self, err: UserError | None) -> None:
        if self.comm.uses_torch and self.comm.world_size > 1:
            self._agree(err, "committing")
            return
        if err is not None:
            if self.file_mode:
                self._note_failure(str(err))
            raise err
        if self.file_mode and self.comm.rank != 0:
            # Rank 0 itself waits up to barrier_timeout for the slowest rank, then commits or fails.
            deadline = time.monotonic() + 2 * self.opts.barrier_timeout + 5
            while mf.read_marker(self.dir) is None:
                failed = _read_json(self.dir / FAILED.format(rank=0))
                if failed is not None and failed.get("save_id") == self.save_id:
                    raise UserError(f"rank 0 could not commit {self.cid.name}: {failed.get('error')}")
                if time.monotonic() > deadline:
                    raise UserError(f"rank 0 did not commit {self.cid.name} within {2 * self.opts.barrier_timeout + 5:.0f} s; "
                                    "it is not committed")
                time.sleep(0.02)


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        d = json.loads(path.read_bytes())
    except (OSError, ValueError):
        return None
    return d if isinstance(d, dict) else None


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
        try:
            save.produce()
        except BaseException as e:
            save.abort(e)
            raise
        assert save.pipeline is not None
        if save.pipeline.error is not None and isinstance(save.pipeline.error, IntegrityError):
            # A buffer changed while it was being snapshotted: tell the caller now.
            err = save.pipeline.error
            save.abort(err)
            raise err
    threading.Thread(target=finish, name=f"ckpt-commit-{save.cid.name}", daemon=True).start()
    return fut
