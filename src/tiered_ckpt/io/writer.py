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

Every file of a save carries the save's id (``shard-r00000-000.<sid>.bin``,
``rank00000.<sid>.part.json``, ``rank00000.<sid>.failed.json``; the marker records it as
``save_id``). AMLFS auto-export never propagates deletes, so the archive may still hold files
of an earlier save of the same name; with unique names a later save can never overwrite one of
them, and a marker only ever names files of its own save.

Who may reuse a name: rank 0 claims it (lock.checkpoint_lock, wait=0) before anything is
written and holds the claim until the marker is written or the save failed; a second saver
of that name gets ConflictError at once and writes nothing. Under the claim rank 0 refuses
a name that is committed anywhere: here (a valid marker), archived and deleted locally by
retention (tombstone.py), or - where an archive is configured - committed in Blob (one
request for `<prefix>/<model>/<name>/COMMITTED.json`). If the archive cannot be reached
the save goes on with a logged warning: training must not stop for the archive, and unique
file names mean no archived blob can be overwritten either way. Also under the claim rank 0
drops retention's delete-journal entry of the name, and removes files of earlier,
never-committed saves of the name (overwrite_incomplete=False refuses instead). Other ranks
only ever delete files carrying their own rank and save id.

Any exception on any rank in any phase (prepare, write, commit) fails every rank: under
torch.distributed through Comm.phase, without torch through failure notes in the directory.

Nothing is followed through a symlink: the model and checkpoint directories are verified
real directories (a symlink is refused, never written into), kept open, and every file is
created relative to that descriptor with O_CREAT|O_EXCL|O_NOFOLLOW and explicit modes
(directories 0755, files 0644, whatever the umask).
"""
from __future__ import annotations

import bisect
import errno
import json
import logging
import os
import queue
import re
import stat
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import ExitStack
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from tiered_ckpt.config import ArchiveConfig
from tiered_ckpt.distributed import ERROR_CLASSES, Comm, as_user_error
from tiered_ckpt.errors import ConflictError, IntegrityError, UserError
from tiered_ckpt.io import commit as mf
from tiered_ckpt.io import fsafe, lock
from tiered_ckpt.io.hashing import new_hasher
from tiered_ckpt.io.pools import ALIGN, Aborted, BlockPool
from tiered_ckpt.io.sources import Source
from tiered_ckpt.lifecycle import journal, tombstone
from tiered_ckpt.naming import CheckpointId

log = logging.getLogger(__name__)

SHARD = "shard-r{rank:05d}-{i:03d}.{sid}.bin"
PART = "rank{rank:05d}.{sid}.part.json"
FAILED = "rank{rank:05d}.{sid}.failed.json"
SAVE_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")
_OWNED = re.compile(r"shard-r(?P<r1>[0-9]{5})-[0-9]{3}\.(?P<s1>.+)\.bin|rank(?P<r2>[0-9]{5})\.(?P<s2>.+)\.(?P<kind>part|failed)\.json")
_SMALL_LIMIT = 256 << 20       # part manifests and notes: far larger than any real one


def file_owner(name: str) -> tuple[int, str, str] | None:
    """(rank, save id, kind) of a file a save writes ("shard", "part", "failed"), else None."""
    m = _OWNED.fullmatch(name)
    if m is None:
        return None
    if m.group("r1") is not None:
        return int(m.group("r1")), m.group("s1"), "shard"
    return int(m.group("r2")), m.group("s2"), m.group("kind")


def require_save_id(save_id: Any) -> str:
    if not isinstance(save_id, str) or SAVE_ID.fullmatch(save_id) is None:
        raise UserError(f"save_id={save_id!r}: must match [A-Za-z0-9][A-Za-z0-9_.-]{{0,63}} (it is part of every file "
                        "name of the save), e.g. save_id=f'{job_id}-{attempt}'")
    return save_id


def new_save_id() -> str:
    return uuid.uuid4().hex

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


def plan(sizes: Sequence[int], nfiles: int, rank: int, sid: str) -> list[FilePlan]:
    """Cut the concatenation of the buffers into <= nfiles shards of equal, 4 KiB-aligned size."""
    total = sum(sizes)
    nfiles = max(1, min(nfiles, -(-total // ALIGN)))
    per_file = -(-total // nfiles)
    per = -(-per_file // ALIGN) * ALIGN if total else 0
    files = [FilePlan(SHARD.format(rank=rank, i=i, sid=sid), 0) for i in range(nfiles)]
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

    def __init__(self, ckpt_dir: Path, dfd: int, files: list[FilePlan], sources: list[Source], pool: BlockPool,
                 opts: WriteOptions, progress: Progress | None) -> None:
        self.dir, self.files, self.sources, self.pool, self.opts = ckpt_dir, files, sources, pool, opts
        self.dfd = dfd
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
        fd, direct = open_data(self.dfd, fp.path, path, self.opts.direct)
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
            if t.is_alive() or t.ident is not None:
                t.join()
        # Drain blocks left in queues by an abort, so the reusable pool stays whole.
        for q in self._chunks:
            while not q.empty():
                self.pool.release(q.get_nowait()[1])
        if self.error is not None:
            raise self.error
        return [e for e in self.entries if e is not None]


def open_data(dfd: int, name: str, path: Path, direct: bool) -> tuple[int, bool]:
    """Create a data file under its final name in the directory `dfd`; O_DIRECT where the file
    system allows it. O_EXCL: the name is unique to this save, so anything already there (a
    planted symlink, FIFO or hard link included) is refused, never followed or truncated."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | getattr(os, "O_NOFOLLOW", 0)
    fd = -1
    if direct and hasattr(os, "O_DIRECT"):
        try:
            fd = os.open(name, flags | os.O_DIRECT, 0o644, dir_fd=dfd)
        except OSError as e:
            if e.errno != errno.EINVAL:   # tmpfs and some FUSE mounts refuse O_DIRECT
                raise os_error(e, path) from None
    used_direct = fd >= 0
    if fd < 0:
        try:
            fd = os.open(name, flags, 0o644, dir_fd=dfd)
        except OSError as e:
            raise os_error(e, path) from None
    try:
        os.fchmod(fd, 0o644)   # explicit: a umask of 000 must not widen it
    except OSError as e:
        os.close(fd)
        raise os_error(e, path) from None
    return fd, used_direct


def pwrite_all(fd: int, view: memoryview, offset: int) -> None:
    while view:
        n = os.pwrite(fd, view, offset)
        if n <= 0:
            raise OSError(errno.EIO, "short write")
        view, offset = view[n:], offset + n


def os_error(e: OSError, path: str | os.PathLike[str]) -> UserError:
    p = Path(path)
    if isinstance(e, fsafe.UnsafePath):
        return UserError(f"{e.filename or p}: {e.strerror}; remove it (it is not the toolkit's) or choose another "
                         "--root; the checkpoint was not committed", exit_code=4)
    if e.errno == errno.EEXIST:
        return UserError(f"{p} already exists: something else created a file under a name that is unique to this save; "
                         "remove it and save again; the checkpoint was not committed", exit_code=4)
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
    if e.errno == errno.ELOOP:
        return UserError(f"{p} is a symbolic link; refused (never followed); remove it; the checkpoint was not committed",
                         exit_code=4)
    return UserError(f"writing {p} failed: {e.strerror or e} (errno {e.errno}); the checkpoint was not committed")


def write_small(dfd: int, name: str, data: bytes) -> None:
    """A small new file (part manifest, failure note) under its final name in `dfd`, fsynced."""
    fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | getattr(os, "O_NOFOLLOW", 0), 0o644,
                 dir_fd=dfd)
    try:
        os.fchmod(fd, 0o644)
        pwrite_all(fd, memoryview(data), 0)
        os.fsync(fd)
    finally:
        os.close(fd)


def read_small(dfd: int, name: str) -> bytes | None:
    """A small regular file of the directory `dfd` (None if absent, not regular, or too large)."""
    try:
        fd = fsafe.open_file(name, dir_fd=dfd)
    except OSError:
        return None
    try:
        chunks: list[bytes] = []
        total = 0
        while True:
            b = os.read(fd, 1 << 20)
            if not b:
                return b"".join(chunks)
            total += len(b)
            if total > _SMALL_LIMIT:
                return None
            chunks.append(b)
    except OSError:
        return None
    finally:
        os.close(fd)


def _json_at(dfd: int, name: str) -> dict[str, Any] | None:
    data = read_small(dfd, name)
    if data is None:
        return None
    try:
        d = json.loads(data)
    except ValueError:
        return None
    return d if isinstance(d, dict) else None


def _redact(text: str) -> str:
    """No credential from a connection string or SAS URL in a log line."""
    text = re.sub(r"(?i)(AccountKey|SharedAccessSignature|sig)=[^&;\s'\"]+", r"\1=REDACTED", text)
    return re.sub(r"(https?://[^\s?'\"]+)\?[^\s'\"]*", r"\1?REDACTED", text)


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


_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC | getattr(os, "O_NOFOLLOW", 0)


def _open_subdir(parent_fd: int, name: str, path: Path, create: bool) -> tuple[int, bool]:
    """(fd, created) of the real directory `name` in `parent_fd`, made fsafe.DIR_MODE if `create` and missing.

    A symlink (or anything not a directory) there is refused, never followed. The new entry is
    made durable by the commit (it fsyncs the model directory and the root before the marker)."""
    created = False
    if create:
        try:
            os.mkdir(name, fsafe.DIR_MODE, dir_fd=parent_fd)
            created = True
        except FileExistsError:
            pass
    try:
        fd = os.open(name, _DIR_FLAGS, dir_fd=parent_fd)
    except OSError as e:
        if e.errno in (errno.ELOOP, errno.ENOTDIR):
            try:
                what = fsafe.kind(os.lstat(name, dir_fd=parent_fd).st_mode)
            except OSError:
                what = "not a directory"
            raise UserError(f"{path} is {what}, not a directory; refused (a save never writes through a symlink "
                            "nor deletes anything it points at): remove it, or choose another --root/model",
                            exit_code=4) from None
        raise
    if created:
        try:
            os.fchmod(fd, fsafe.DIR_MODE)   # explicit: the umask must not decide (fsafe.DIR_MODE says why)
        except BaseException:
            os.close(fd)
            raise
    return fd, created


class Save:
    """One save of one rank: prepare (caller's thread), produce, then finish and commit.

    Every phase ends in an agreement of all ranks (Comm.phase); a failure anywhere fails all.
    """

    def __init__(self, root: Path, model: str, cid: CheckpointId, sources: list[Source], comm: Comm,
                 opts: WriteOptions, pool: BlockPool, *, overwrite_incomplete: bool = True,
                 save_id: str | None = None, progress: Progress | None = None,
                 archive: ArchiveConfig | None = None) -> None:
        self.root, self.model, self.cid, self.sources, self.comm, self.opts = Path(root), model, cid, sources, comm, opts
        self.pool, self.overwrite_incomplete, self.progress = pool, overwrite_incomplete, progress
        self.archive = archive
        self.mdir = self.root / model
        self.dir = self.mdir / cid.name
        self.t0 = time.perf_counter()
        self.pipeline: _Pipeline | None = None
        self.files: list[FilePlan] = []
        self.dfd: int | None = None
        self.entries: list[mf.FileEntry] = []
        self._claim: ExitStack | None = None
        self._pending: BaseException | None = None   # a local failure the next agreement reports
        self._marker_attempted = False                # from here on nothing of this save is deleted
        self._noted = False
        self._closed = False
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

    def started(self, ids: list[str | None]) -> None:
        """After the prepare agreement: adopt rank 0's save id, open the directory, start the writers."""
        try:
            if self.comm.collective:
                sid = ids[0]
                assert isinstance(sid, str)
                self.save_id = sid
                if self.comm.rank != 0:
                    self.dfd = fsafe.open_dir(self.dir, anchor=self.root)
            self._start()
        except BaseException as e:  # noqa: BLE001 - reported to every rank at the next agreement
            self.fail(e)

    def prepare_local(self) -> str | None:
        mf.require_root(self.root)
        try:
            if self.comm.rank == 0:
                return self._prepare_rank0()
            if self.file_mode:
                self._prepare_other_rank()
            return None
        except OSError as e:   # fsafe.UnsafePath included: one message naming the path
            raise os_error(e, self.dir) from None

    def _open_model_dir(self, create: bool) -> int:
        rfd = os.open(self.root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            try:
                fd, _ = _open_subdir(rfd, self.model, self.mdir, create)
            except OSError as e:
                raise os_error(e, self.mdir) from None
            return fd
        finally:
            os.close(rfd)

    def _prepare_rank0(self) -> str:
        mfd = self._open_model_dir(create=True)
        try:
            claim = ExitStack()
            try:
                claim.enter_context(lock.checkpoint_lock(self.root, self.model, self.cid.name, "save", wait=0))
            except ConflictError as e:
                raise ConflictError(f"cannot save {self.cid.name} now: {e}; this save wrote nothing — if it is another "
                                    "save of the same step, save under another epoch/step") from None
            self._claim = claim
            self._refuse_if_committed(mfd)
            journal.forget(self.root, self.model, self.cid.name)
            self.dfd, _ = _open_subdir(mfd, self.cid.name, self.dir, create=True)
        finally:
            os.close(mfd)
        if not os.access(self.dir, os.W_OK):
            raise UserError(f"cannot write to {self.dir}: permission denied; fix its permissions or choose another --root")
        self._clear_stale()
        return self.save_id

    def _refuse_if_committed(self, mfd: int) -> None:
        """ConflictError if the name is committed on either tier (rank 0, holding the claim)."""
        try:
            st = os.lstat(self.cid.name, dir_fd=mfd)
        except FileNotFoundError:
            st = None
        if st is not None and stat.S_ISDIR(st.st_mode):
            fd, _ = _open_subdir(mfd, self.cid.name, self.dir, create=False)
            try:
                m = self._valid_marker(fd)
            finally:
                os.close(fd)
            if m is not None:
                raise ConflictError(
                    f"{self.dir} is already a committed checkpoint; committed checkpoints are never overwritten — "
                    "save under another epoch/step, or delete it first (tiered-ckpt retention)"
                )
        elif st is not None:
            _open_subdir(mfd, self.cid.name, self.dir, create=False)   # raises: a symlink or a file
        if tombstone.present(self.root, self.model, self.cid.name):
            raise ConflictError(
                f"{self.cid.name} is committed in the archive (retention deleted it here after archiving it: "
                f"{tombstone.tombstone_path(self.root, self.model, self.cid.name)}); committed checkpoints are never "
                f"overwritten — save under another epoch/step, or bring it back with `tiered-ckpt restore {self.cid.name}`"
            )
        if self._committed_in_archive():
            raise ConflictError(
                f"{self.cid.name} is committed in the archive ({self.model}/{self.cid.name}/{mf.MARKER} exists in Blob); "
                "committed checkpoints are never overwritten — save under another epoch/step, or bring it back with "
                f"`tiered-ckpt restore {self.cid.name}`"
            )

    def _valid_marker(self, dfd: int) -> mf.Manifest | None:
        data = read_small(dfd, mf.MARKER)
        if data is None:
            return None
        try:
            m = mf.Manifest.from_json(data)
        except ValueError:
            return None
        return m if m.id == self.cid else None

    def _committed_in_archive(self) -> bool:
        """Whether Blob holds this name's marker; False (with a warning) if the archive cannot be asked."""
        if self.archive is None or not (self.archive.connection_string or self.archive.account_url):
            return False
        rel = f"{self.model}/{self.cid.name}/{mf.MARKER}"
        try:
            from tiered_ckpt.tiers import blob as blobstore  # the azure SDK only where an archive is configured

            # One attempt, short timeouts: a save must not wait minutes for an unreachable archive.
            store = blobstore.BlobStore(replace(self.archive, retries=0), connection_timeout=5.0, read_timeout=15.0)
            return store.exists(rel)
        except Exception as e:  # noqa: BLE001 - any failure to ask means "unknown", never "stop training"
            msg = str(e).splitlines()[0][:300] if str(e) else type(e).__name__
            log.warning("could not check whether %s is committed in the archive (%s); saving anyway: file names are "
                        "unique per save, so no archived file can be overwritten", self.cid.name, _redact(msg))
            return False

    def _clear_stale(self) -> None:
        """Remove what earlier, never-committed saves of this name left (rank 0, under the claim).

        Files of this save (other ranks may already be writing them) stay. A directory inside
        is never removed (no save creates one: it may hold anyone's files): refused instead.
        """
        assert self.dfd is not None
        stale: list[str] = []
        with os.scandir(self.dfd) as it:
            for e in it:
                owner = file_owner(e.name)
                if owner is not None and owner[1] == self.save_id and owner[0] != self.comm.rank:
                    continue            # another rank of this very save is writing it
                if e.is_dir(follow_symlinks=False):
                    raise UserError(
                        f"cannot write {self.dir}: it holds a directory {e.name!r} that no save creates; it is never "
                        "removed automatically (it may not be ours) — remove it or save under another epoch/step; "
                        "the checkpoint was not committed", exit_code=4)
                stale.append(e.name)
        if stale and not self.overwrite_incomplete:
            raise ConflictError(
                f"{self.dir} holds an earlier save of {self.cid.name} that never committed (no valid {mf.MARKER}); "
                "pass overwrite_incomplete=True to replace it, or remove the directory"
            )
        for name in stale:
            try:
                os.unlink(name, dir_fd=self.dfd)   # unlink never follows a symlink
            except FileNotFoundError:
                pass
        if stale:
            os.fsync(self.dfd)

    def _prepare_other_rank(self) -> None:
        """File mode, rank > 0: the directories (rank 0 may not be there yet), own stale files of this id."""
        mfd = self._open_model_dir(create=True)
        try:
            self.dfd, _ = _open_subdir(mfd, self.cid.name, self.dir, create=True)
        finally:
            os.close(mfd)
        m = self._valid_marker(self.dfd)
        if m is not None:
            raise ConflictError(
                f"{self.dir} is already a committed checkpoint; committed checkpoints are never overwritten — "
                "save under another epoch/step"
            )
        self._cleanup_own(keep_note=False)   # a crashed attempt that used this same save id

    def _start(self) -> None:
        assert self.dfd is not None
        self.files = plan([s.nbytes for s in self.sources], self.opts.files, self.comm.rank, self.save_id)
        self.pipeline = _Pipeline(self.dir, self.dfd, self.files, self.sources, self.pool, self.opts, self.progress)
        self.pipeline.rank = self.comm.rank
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
            self._write_part(entries)
        except OSError as e:
            raise os_error(e, self.dir) from None
        self.entries = entries
        if self.file_mode and self.comm.rank == 0:
            self._wait_for_parts()

    def _commit_local(self) -> None:
        if self.comm.rank == 0:
            try:
                self._commit()
            except OSError as e:
                raise os_error(e, self.dir / mf.MARKER) from None
            self._release()
        elif self.file_mode:
            self._wait_for_marker()

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
            if not self._marker_attempted:
                self._cleanup_own(keep_note=True)
                if self.comm.world_size == 1:
                    self._remove_dir_if_empty()
        finally:
            self._close()      # the save is over: release the claim, close the directory

    def _release(self) -> None:
        claim, self._claim = self._claim, None
        if claim is not None:
            claim.close()

    def _close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._release()
        if self.dfd is not None:
            os.close(self.dfd)
            self.dfd = None

    def _cleanup_own(self, keep_note: bool) -> None:
        """Remove this rank's files of this save id only: never another save's, never another rank's."""
        if self.dfd is None:
            return
        removed = False
        try:
            with os.scandir(self.dfd) as it:
                names = [e.name for e in it]
            for name in names:
                owner = file_owner(name)
                if owner is None or owner[0] != self.comm.rank or owner[1] != self.save_id:
                    continue
                if keep_note and owner[2] == "failed":
                    continue
                try:
                    os.unlink(name, dir_fd=self.dfd)
                    removed = True
                except FileNotFoundError:
                    pass
            if removed:
                os.fsync(self.dfd)
        except OSError:
            pass   # best effort: the next save of this name removes what is left, under its claim

    def _remove_dir_if_empty(self) -> None:
        try:
            mfd = fsafe.open_dir(self.mdir, anchor=self.root)
        except OSError:
            return
        try:
            os.rmdir(self.cid.name, dir_fd=mfd)   # only if empty: never removes anything another writer put there
            os.fsync(mfd)
        except OSError:
            pass
        finally:
            os.close(mfd)

    def _write_part(self, entries: list[mf.FileEntry]) -> None:
        assert self.dfd is not None
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
        write_small(self.dfd, PART.format(rank=self.comm.rank, sid=self.save_id), json.dumps(part, sort_keys=True).encode())
        os.fsync(self.dfd)

    def _note_failure(self, exc: BaseException) -> None:
        """File mode: tell the other ranks (they poll for it) that this rank failed."""
        if self._noted:
            return
        self._noted = True
        note_failure(self.root, self.model, self.cid, self.comm.rank, self.comm.world_size, self.save_id, exc, self.dfd)

    # -- file mode waits ----------------------------------------------------------------
    def _wait_for_parts(self) -> None:
        assert self.dfd is not None
        deadline = time.monotonic() + self.opts.barrier_timeout
        missing = set(range(1, self.comm.world_size))
        while missing:
            for r in sorted(missing):
                failed = _json_at(self.dfd, FAILED.format(rank=r, sid=self.save_id))
                if failed is not None and failed.get("save_id") == self.save_id:
                    raise _noted_error(failed, f"rank {r} failed while writing {self.cid.name}: {failed.get('error')}",
                                       "; nothing was committed")
                part = _json_at(self.dfd, PART.format(rank=r, sid=self.save_id))
                if part is not None and part.get("save_id") == self.save_id:
                    missing.discard(r)
            if missing and time.monotonic() > deadline:
                raise UserError(
                    f"rank(s) {sorted(missing)} did not finish writing {self.cid.name} within {self.opts.barrier_timeout:.0f} s "
                    f"(no {PART.format(rank=min(missing), sid=self.save_id)}); nothing was committed"
                )
            if missing:
                time.sleep(0.02)

    def _wait_for_marker(self) -> None:
        """Rank > 0 without torch: rank 0 waits up to barrier_timeout for the slowest rank, then commits or fails."""
        assert self.dfd is not None
        limit = 2 * self.opts.barrier_timeout + 5
        deadline = time.monotonic() + limit
        while True:
            m = self._valid_marker(self.dfd)
            if m is not None:
                if m.save_id == self.save_id:
                    return
                raise ConflictError(f"another save (save id {m.save_id!r}) committed {self.cid.name} while this one was "
                                    "writing; this save's files are not part of it — save under another epoch/step")
            failed = _json_at(self.dfd, FAILED.format(rank=0, sid=self.save_id))
            if failed is not None and failed.get("save_id") == self.save_id:
                raise _noted_error(failed, f"rank 0 could not commit {self.cid.name}: {failed.get('error')}",
                                   "; this rank's files are not committed")
            if time.monotonic() > deadline:
                raise UserError(f"rank 0 did not commit {self.cid.name} within {limit:.0f} s; it is not committed")
            time.sleep(0.02)

    # -- rank 0 --------------------------------------------------------------------------
    def _commit(self) -> None:
        assert self.dfd is not None
        parts: list[dict[str, Any]] = []
        files: list[mf.FileEntry] = []
        for r in range(self.comm.world_size):
            name = PART.format(rank=r, sid=self.save_id)
            data = read_small(self.dfd, name)
            part: Any = None
            if data is not None:
                try:
                    part = json.loads(data)
                except ValueError:
                    part = None
            # Only this save's own parts: the id is in the name and inside, and must match both.
            if (not isinstance(part, dict) or part.get("save_id") != self.save_id or part.get("rank") != r
                    or part.get("checkpoint") != self.cid.name):
                raise IntegrityError(f"part manifest of rank {r} ({self.dir / name}) is missing or not of this save; "
                                     "nothing was committed")
            assert data is not None
            parts.append(part)
            files += [mf.FileEntry(**f) for f in part["files"]]
            h = new_hasher()
            h.update(data)
            files.append(mf.FileEntry(name, len(data), h.hexdigest(), r))   # the bytes just parsed, hashed
        index = {"save_id": self.save_id, "ranks": {str(r): p["index"] for r, p in enumerate(parts)}}
        m = mf.Manifest(epoch=self.cid.epoch, step=self.cid.step, files=files, world_size=self.comm.world_size,
                        index=index, save_id=self.save_id)
        listed = {f.path for f in files}
        removed = False
        with os.scandir(self.dfd) as it:
            names = [(e.name, e.is_dir(follow_symlinks=False)) for e in it]
        for name, is_dir in names:
            if name not in listed and name != mf.MARKER and not is_dir:
                try:
                    os.unlink(name, dir_fd=self.dfd)   # left by an earlier attempt or a losing saver; never followed
                    removed = True
                except FileNotFoundError:
                    pass
        if removed:
            os.fsync(self.dfd)
        problems = []
        for f in files:
            try:
                st = os.stat(f.path, dir_fd=self.dfd, follow_symlinks=False)
            except FileNotFoundError:
                problems.append(f"{self.dir / f.path}: missing")
                continue
            if not stat.S_ISREG(st.st_mode) or st.st_size != f.size:
                problems.append(f"{self.dir / f.path}: {st.st_size} bytes, manifest says {f.size}"
                                if stat.S_ISREG(st.st_mode) else f"{self.dir / f.path}: not a regular file")
        if problems:
            raise IntegrityError(f"{self.cid.name} not committed: " + "; ".join(problems))
        # The marker is written by path: the path must still be the directory written into.
        try:
            now = fsafe.open_dir(self.dir, anchor=self.root)
        except OSError as e:
            raise IntegrityError(f"{self.dir} was replaced while saving ({e.strerror}); {self.cid.name} not committed") from None
        try:
            a, b = os.fstat(now), os.fstat(self.dfd)
        finally:
            os.close(now)
        if (a.st_dev, a.st_ino) != (b.st_dev, b.st_ino):
            raise IntegrityError(f"{self.dir} was replaced by another directory while saving; {self.cid.name} not committed")
        # The directory entries (checkpoint in model, model in root) are durable before the marker:
        # a power loss must not keep the marker and lose the directory holding it.
        self._sync_parents()
        self._marker_attempted = True
        mf.write_marker(self.dir, m, dir_fd=self.dfd)

    def _sync_parents(self) -> None:
        mfd = fsafe.open_dir(self.mdir, anchor=self.root)
        try:
            os.fsync(mfd)
        finally:
            os.close(mfd)
        rfd = os.open(self.root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            os.fsync(rfd)
        finally:
            os.close(rfd)


def note_failure(root: Path, model: str, cid: CheckpointId, rank: int, world_size: int, sid: str,
                 exc: BaseException, dfd: int | None = None) -> None:
    """File mode: leave `rank{r}.<sid>.failed.json` so the other ranks stop at once (best effort).

    Also for a rank that failed before its save was set up. The directory is made if missing
    (the other ranks wait in it); a note is never added to a committed checkpoint."""
    err = as_user_error(exc, rank, world_size, "saving", cid.name)
    own = dfd is None
    try:
        if dfd is None:
            rfd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
            try:
                mfd, _ = _open_subdir(rfd, model, Path(root) / model, create=True)
            finally:
                os.close(rfd)
            try:
                dfd, _ = _open_subdir(mfd, cid.name, Path(root) / model / cid.name, create=True)
            finally:
                os.close(mfd)
        try:
            m = mf.Manifest.from_json(read_small(dfd, mf.MARKER) or b"")
            if m.id == cid:
                return
        except ValueError:
            pass
        write_small(dfd, FAILED.format(rank=rank, sid=sid),
                    json.dumps({"save_id": sid, "error": str(err), "error_class": type(err).__name__,
                                "exit_code": err.exit_code}).encode())
        os.fsync(dfd)
    except (OSError, UserError):
        pass
    finally:
        if own and dfd is not None:
            os.close(dfd)


def _noted_error(note: dict[str, Any], message: str, tail: str) -> UserError:
    """The error a failure note describes, of its class (a ConflictError stays one)."""
    code = note.get("exit_code")
    code = code if isinstance(code, int) and not isinstance(code, bool) and 0 < code < 128 else None
    cls = ERROR_CLASSES.get(str(note.get("error_class")), UserError)
    return cls(message if "not committed" in message else message + tail, exit_code=code)


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
