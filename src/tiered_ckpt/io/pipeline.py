"""The write pipeline of one rank: copy threads fill pool blocks, writer threads write them.

A producer copies the bytes into page-aligned pool blocks (see pools.py), round-robin over the
shards being written, and writer threads (one shard each at a time) hash every block inline
(xxh3-128) and write it with O_DIRECT; the last partial block is zero-padded, written, and the
file truncated to its true size. Every shard is fsynced (the directory by the caller).

A block whose bytes are already staged (one run of page-aligned memory declared by
sources.hold_stable: the async staging area, TieredStager's pool) is not copied: the writer
hashes it and writes it with O_DIRECT straight from the staging memory (`totals` counts both ways).
"""
from __future__ import annotations

import os
import queue
import threading
from collections import deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from tiered_ckpt.errors import IntegrityError
from tiered_ckpt.io.hashing import new_hasher
from tiered_ckpt.io.layout import FilePlan
from tiered_ckpt.io.marker import FileEntry
from tiered_ckpt.io.options import WriteOptions
from tiered_ckpt.io.pools import ALIGN, Aborted, BlockPool
from tiered_ckpt.io.posix import open_data, os_error, pwrite_all
from tiered_ckpt.io.sources import Source, byte_view, is_stable

Progress = Callable[[int], None]

# Bytes this process's pipelines copied into ring blocks ("ring") and wrote straight from staged
# memory ("staged"): for tests and benchmarks.
totals: dict[str, int] = dict.fromkeys(("ring", "staged"), 0)
_totals_lock = threading.Lock()
_STAGED = -1        # the block index of a chunk written from staged memory (no pool block)


class Pipeline:
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
        # (file offset, pool block or _STAGED, bytes, staged address)
        self._chunks: list[queue.Queue[tuple[int, int, int, int]]] = [queue.Queue() for _ in files]
        self._sched_lock = threading.Lock()
        self._pending = deque(range(len(files)))
        self._active: list[list[int]] = []
        self._rr = 0
        # Copy threads: memmove releases the GIL, so several cores share the snapshot copy.
        self.ncopy = max(1, min(opts.copy_threads or (os.cpu_count() or 1), self.pool.nblocks // 2 or 1, 8))
        self.entries: list[FileEntry | None] = [None] * len(files)
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
        # Wake writers still waiting for their first shard: a failure before produce() ran (or one
        # that skipped its end) would otherwise leave them, and finish() joining them, blocked.
        for _ in self._threads:
            self._work.put(None)

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
            at = self._staged(self.files[fi], off, n)
            if at is not None:
                self.pool.release(idx)
                self._chunks[fi].put((off, _STAGED, n, at))
                continue
            try:
                self._fill(idx, self.files[fi], off, n)
            except BaseException:
                self.pool.release(idx)
                raise
            with _totals_lock:
                totals["ring"] += n
            self._chunks[fi].put((off, idx, n, 0))

    def _staged(self, fp: FilePlan, file_off: int, n: int) -> int | None:
        """The address of the block's bytes if they are one page-aligned run of staged memory
        (with the padding an O_DIRECT write of its tail needs), else None."""
        si = fp.locate(file_off)
        pos, start = 0, None
        while pos < n:
            seg = fp.segments[si]
            src = self.sources[seg.source]
            if src.address is None or src.device_bytes is not None or src.kind == "stream":
                return None
            into = file_off + pos - seg.file_offset
            addr = src.address + seg.src_offset + into
            if start is None:
                if addr % ALIGN:
                    return None
                start = addr
            elif addr != start + pos:
                return None
            pos += min(seg.nbytes - into, n - pos)
            si += 1
        if start is None or not is_stable(start, -(-n // ALIGN) * ALIGN):
            return None
        return start

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

    def _next_chunk(self, fi: int, off: int, held: dict[int, tuple[int, int, int]]) -> tuple[int, int, int]:
        """The block holding `off` of shard fi; copy threads may deliver blocks out of order."""
        q = self._chunks[fi]
        while off not in held:
            try:
                o, idx, n, at = q.get(timeout=0.05)
                held[o] = (idx, n, at)
            except queue.Empty:
                if self.aborted.is_set():
                    raise Aborted() from None
        return held.pop(off)

    def _write_file(self, fi: int, hasher: ThreadPoolExecutor) -> FileEntry:
        fp = self.files[fi]
        path = self.dir / fp.path
        fd, direct = open_data(self.dfd, fp.path, path, self.opts.direct)
        if not direct:
            self.direct_used = False
        held: dict[int, tuple[int, int, int]] = {}
        try:
            h = new_hasher() if self.opts.hash else None
            off = 0
            while off < fp.size:
                idx, n, at = self._next_chunk(fi, off, held)
                try:
                    wlen = -(-n // ALIGN) * ALIGN if direct and n % ALIGN else n
                    if idx == _STAGED:
                        # Staged bytes (unchanged until this save ends): hashed and written from there.
                        view = byte_view(at, wlen)
                    else:
                        view = self.pool.view(idx)
                        if wlen > n:
                            view[n:wlen] = bytes(wlen - n)
                    # Hash on a helper thread while this one writes the same block: xxh3 releases
                    # the GIL, so the hash costs no device time (blocks stay in order per shard).
                    hashed = hasher.submit(h.update, view[:n]) if h is not None else None
                    try:
                        pwrite_all(fd, view[:wlen], off)
                    finally:
                        if hashed is not None:
                            hashed.result()
                finally:
                    if idx != _STAGED:
                        self.pool.release(idx)
                if idx == _STAGED:
                    with _totals_lock:
                        totals["staged"] += n
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
            for idx, _, _ in held.values():
                if idx != _STAGED:
                    self.pool.release(idx)
        return FileEntry(fp.path, fp.size, h.hexdigest() if h is not None else None, self.rank)

    def finish(self) -> list[FileEntry]:
        for t in self._threads:
            if t.is_alive() or t.ident is not None:
                t.join()
        # Drain blocks left in queues by an abort, so the reusable pool stays whole.
        for q in self._chunks:
            while not q.empty():
                idx = q.get_nowait()[1]
                if idx != _STAGED:
                    self.pool.release(idx)
        if self.error is not None:
            raise self.error
        return [e for e in self.entries if e is not None]
