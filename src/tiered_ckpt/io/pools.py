"""Reusable host memory for saves: pools of page-aligned blocks, and the async staging area.

A synchronous save streams through a small pool (io.sync_buffer_bytes), so it adds bounded
memory, never the checkpoint's size. Pools are allocated once per process and size,
pre-faulted (first-touch page faults cost more than the copy itself), and reused by every
later save. Blocks are page aligned, as O_DIRECT requires.

An async save snapshots into the staging area (`staging_area()`): one anonymous mapping of
this process, sized to what is being saved, not to the budget. It grows (a new, pre-faulted
mapping) when a save needs more than it holds, is reused as it is by every save that fits,
and is given back on request (`release_staging()`, also `tiered_ckpt.release_staging()`).
Its budget is io.staging_bytes (IoOptions.staging_bytes): a save whose snapshot would need
more streams through a ring of that size instead (`snapshot` says how). One save holds the
area at a time, from its snapshot until its background write ended.
"""
from __future__ import annotations

import ctypes
import errno
import mmap
import os
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from tiered_ckpt.errors import ConfigError, IntegrityError, UserError
from tiered_ckpt.io.posix import ALIGN
from tiered_ckpt.io.sources import Source, copy_from_device, drop_stable, hold_stable, pin_host


class Aborted(Exception):
    """The save using this pool failed; whoever waits for a block stops."""


def _mapping(nbytes: int) -> mmap.mmap:
    """Anonymous private memory, pre-faulted by the kernel (MAP_POPULATE, mmap(2)): faulting it in
    page by page during the first copy costs more than the copy itself."""
    flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | getattr(mmap, "MAP_POPULATE", 0)
    return mmap.mmap(-1, nbytes, flags=flags)      # OSError(ENOMEM): see pool() / StagingArea


def block_geometry(total_bytes: int, block_size: int) -> tuple[int, int]:
    """(block size, block count) of a pool of `total_bytes`: two blocks at least."""
    block_size = max(ALIGN, block_size // ALIGN * ALIGN)
    if total_bytes < 2 * block_size:
        # Two blocks at least, so copying and writing overlap; shrink blocks to fit the budget.
        block_size = max(ALIGN, (total_bytes // 2) // ALIGN * ALIGN)
    return block_size, max(2, total_bytes // block_size)


class BlockPool:
    def __init__(self, total_bytes: int, block_size: int, *, memory: tuple[memoryview, int] | None = None) -> None:
        """`memory`: (view, address) of memory to carve the blocks from (the staging area), else its own."""
        self.block_size, self.nblocks = block_geometry(total_bytes, block_size)
        if memory is None:
            self._mem: mmap.mmap | None = _mapping(self.nblocks * self.block_size)
            self._view = memoryview(self._mem)
            self._base = ctypes.addressof(ctypes.c_char.from_buffer(self._mem))
        else:
            self._mem = None
            self._view, self._base = memory
            assert len(self._view) >= self.nblocks * self.block_size and self._base % ALIGN == 0
        self._free: deque[int] = deque(range(self.nblocks))
        self._cond = threading.Condition()

    @property
    def nbytes(self) -> int:
        return self.nblocks * self.block_size

    def acquire(self, is_aborted: threading.Event | None = None) -> int:
        with self._cond:
            while not self._free:
                if is_aborted is not None and is_aborted.is_set():
                    raise Aborted()
                self._cond.wait(0.05)
            return self._free.popleft()

    def release(self, idx: int) -> None:
        with self._cond:
            self._free.append(idx)
            self._cond.notify()

    def view(self, idx: int) -> memoryview:
        o = idx * self.block_size
        return self._view[o:o + self.block_size]

    def address(self, idx: int) -> int:
        return self._base + idx * self.block_size


_pools: dict[tuple[str, int, int], BlockPool] = {}
_pools_lock = threading.Lock()


def pool(kind: str, total_bytes: int, block_size: int) -> BlockPool:
    """The process-wide pool of this kind ('sync', 'staging', 'read') and size, created on first use."""
    key = (kind, total_bytes, block_size)
    with _pools_lock:
        p = _pools.get(key)
        if p is None:
            try:
                p = BlockPool(total_bytes, block_size)
            except (MemoryError, OverflowError, ValueError) as e:
                raise _no_memory(kind, total_bytes, block_size, str(e) or type(e).__name__) from None
            except OSError as e:
                if e.errno not in (errno.ENOMEM, errno.EOVERFLOW, errno.EINVAL, errno.EAGAIN):
                    raise
                raise _no_memory(kind, total_bytes, block_size, e.strerror or str(e)) from None
            _pools[key] = p
        return p


_SETTING = {
    "read": "io.threads x io.block_size (one block per reader thread)",
    "sync": "io.sync_buffer_bytes (or options=IoOptions(buffer_bytes=...))",
    "staging": "what the async save snapshots, at most io.staging_bytes (or options=IoOptions(staging_bytes=...))",
}


def _gib(n: int) -> str:
    return f"{n / (1 << 30):.3g} GiB" if n >= 1 << 30 else f"{n / (1 << 20):.3g} MiB"


def _no_memory(kind: str, total: int, block: int, why: str) -> ConfigError:
    return ConfigError(
        f"cannot allocate the {kind} buffer pool: {_gib(max(total, 2 * block))} of host memory ({why}); its size is "
        f"{_SETTING.get(kind, 'io.block_size')}, with io.block_size={_gib(block)}. Lower io.block_size "
        "(16MiB suits Lustre), io.threads or io.staging_bytes / io.sync_buffer_bytes in the node config "
        "(or the --block / --threads flags), or free memory on this node"
    )


# -- the async staging area ---------------------------------------------------------------------

COPY_CHUNK = 64 << 20       # a large source is copied by several threads in pieces of this size


def _round_up(n: int) -> int:
    """Mapping sizes: whole 2 MiB (a transparent huge page) from 2 MiB on, else whole pages."""
    unit = 2 << 20 if n >= 2 << 20 else ALIGN
    return max(ALIGN, -(-n // unit) * unit)


class StagingArea:
    """This process's async staging memory: grown on demand, reused, released on request.

    Counters (for tests and benchmarks): `nbytes` mapped now, `peak_bytes` (the most mapped
    since the last release), `mappings` (how often it grew), `leases` (saves served), `releases`.
    """

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._mem: mmap.mmap | None = None
        self._view: memoryview | None = None
        self._base = 0
        self._unpin: Callable[[], None] | None = None
        self._busy = False
        self._release_when_idle = False
        self.nbytes = 0
        self.peak_bytes = 0
        self.mappings = 0
        self.leases = 0
        self.releases = 0

    @property
    def in_use(self) -> bool:
        return self._busy

    @property
    def pinned(self) -> bool:
        """Page-locked for device-to-host copies (a save of CUDA tensors did it)."""
        return self._unpin is not None

    def lease(self, nbytes: int, timeout: float) -> Lease:
        """Hold the area, at least `nbytes` of it, waiting up to `timeout` s for the save holding it."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while self._busy:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise UserError(f"the async staging area is still held by an earlier save after {timeout:g} s; "
                                    "wait for it (its handle's wait()) before the next async_save")
                self._cond.wait(min(left, 1.0))
            self._busy = True
            self._release_when_idle = False
        try:
            if nbytes > self.nbytes:
                self._grow(nbytes)
        except BaseException:
            self._done()
            raise
        self.leases += 1
        assert self._view is not None
        return Lease(self, self._view[:max(nbytes, 0)], self._base)

    def _grow(self, nbytes: int) -> None:
        self._drop()                   # the old contents are not needed: the area is idle
        size = _round_up(nbytes)
        try:
            mem = _mapping(size)
        except (MemoryError, OverflowError, ValueError) as e:
            raise _no_staging(size, str(e) or type(e).__name__) from None
        except OSError as e:
            if e.errno not in (errno.ENOMEM, errno.EOVERFLOW, errno.EINVAL, errno.EAGAIN):
                raise
            raise _no_staging(size, e.strerror or str(e)) from None
        self._mem, self._view = mem, memoryview(mem)
        self._base = ctypes.addressof(ctypes.c_char.from_buffer(mem))
        self.nbytes = size
        self.peak_bytes = max(self.peak_bytes, size)
        self.mappings += 1

    def pin(self) -> None:
        """Page-lock the area for device-to-host copies (CUDA: cudaHostRegister), once per mapping."""
        if self._unpin is None and self.nbytes:
            self._unpin = pin_host(self._base, self.nbytes)

    def _drop(self) -> int:
        mem, view, unpin = self._mem, self._view, self._unpin
        freed = self.nbytes
        self._mem = self._view = self._unpin = None
        self._base = self.nbytes = 0
        if unpin is not None:
            unpin()
        if view is not None:
            view.release()
        if mem is not None:
            try:
                mem.close()
            except BufferError:
                # Views of it are still referenced somewhere (an old save's sources): give the
                # pages back now (madvise(2) MADV_DONTNEED); the address range goes with the views.
                mem.madvise(mmap.MADV_DONTNEED)
        return freed

    def _done(self) -> None:
        with self._cond:
            self._busy = False
            if self._release_when_idle:
                self._release_when_idle = False
                self._drop()
                self.releases += 1
                self.peak_bytes = 0
            self._cond.notify_all()

    def release(self) -> int:
        """Give the memory back: bytes freed now; 0 if none, or if a save holds it (then it goes
        when that save's write ended)."""
        with self._cond:
            if self._busy:
                self._release_when_idle = True
                return 0
            freed = self._drop()
            if freed:
                self.releases += 1
            self.peak_bytes = 0
            return freed


def _no_staging(size: int, why: str) -> ConfigError:
    return ConfigError(f"cannot map {_gib(size)} of async staging memory for this save ({why}); lower "
                       "io.staging_bytes in the node config (or options=IoOptions(staging_bytes=...)): a state larger "
                       "than it streams through that much instead; or free memory on this node")


class Lease:
    """One save's hold on the staging area: `view`/`address` of the bytes it may use."""

    def __init__(self, area: StagingArea, view: memoryview, address: int) -> None:
        self.area, self.view, self.address = area, view, address
        self._closed = False
        # Unchanged until the save ends (one lease at a time): the writers write from it.
        self._stable = hold_stable(address, len(view))

    def close(self) -> None:
        """The save is over (written, or failed): the next save may use the area."""
        if not self._closed:
            self._closed = True
            drop_stable(self._stable)
            self.area._done()


_staging = StagingArea()


def staging_area() -> StagingArea:
    """The process-wide async staging area."""
    return _staging


def release_staging() -> int:
    """Free the async staging area's memory (after the save holding it, if one does); returns the
    bytes freed now. The next async_save maps what it needs again."""
    return _staging.release()


def mapped_bytes() -> int:
    """Host memory held by this process's pools and staging area (for accounting)."""
    with _pools_lock:
        held = sum(p.nbytes for p in _pools.values())
    return held + _staging.nbytes


class Snapshot:
    """What an async save writes from: `sources` and the `pool` to stream them through.

    streaming=False: `sources` are copies in the staging area (the caller's buffers are free);
    the background write streams them through `pool`, a small ring in the same area.
    streaming=True: the state did not fit the budget; `sources` are the caller's and `pool` is
    the whole budget: the caller's thread copies through it while the writers drain it.
    """

    def __init__(self, sources: list[Source], pool: BlockPool, streaming: bool, lease: Lease) -> None:
        self.sources, self.pool, self.streaming, self.lease = sources, pool, streaming, lease

    def close(self) -> None:
        self.lease.close()


def _aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def snapshot(sources: list[Source], *, budget: int, block_size: int, ring_bytes: int, copy_threads: int | None,
             timeout: float) -> Snapshot:
    """Copy `sources` into the staging area (the caller's buffers are free once this returns).

    Needs sum(sizes) plus a write ring (at most `ring_bytes`, less for a small save) of the
    area; more than `budget` streams instead (Snapshot says how). The copy is large memmoves
    (ctypes releases the GIL) on up to `copy_threads` threads (default: one per core, at most
    8); device memory is copied on a side stream into pinned pages (sources.copy_from_device).
    """
    # Packed as the files lay them out (layout.plan: the concatenation, shards 4 KiB-aligned in
    # it), so every block of every shard is one page-aligned run of staged bytes the writers
    # write straight from; the tail's padding is zeroed (an O_DIRECT write of it reads it).
    total = _aligned(sum(s.nbytes for s in sources))
    ring_bs, ring_n = block_geometry(max(2 * ALIGN, min(ring_bytes, total)), block_size)
    ring = ring_bs * ring_n
    area = _staging
    if ring + total > budget:
        bs, n = block_geometry(budget, block_size)        # two blocks at least, even for a tiny budget
        lease = area.lease(bs * n, timeout)
        try:
            pool = BlockPool(bs * n, bs, memory=(lease.view, lease.address))
        except BaseException:
            lease.close()
            raise
        return Snapshot(sources, pool, True, lease)
    lease = area.lease(ring + total, timeout)
    try:
        pool = BlockPool(ring, ring_bs, memory=(lease.view[:ring], lease.address))
        staged = _copy_all(sources, lease, ring, copy_threads)
    except BaseException:
        lease.close()
        raise
    return Snapshot(staged, pool, False, lease)


class _StagedStream:
    """A stream source's staged bytes (the Source keeps its kind, so the index is unchanged)."""

    def __init__(self, view: memoryview) -> None:
        self.nbytes = len(view)
        self._view = view

    def copy_into(self, offset: int, out: memoryview) -> None:
        out[:] = self._view[offset:offset + len(out)]


def _copy_all(sources: list[Source], lease: Lease, start: int, copy_threads: int | None) -> list[Source]:
    tasks: list[tuple[Source, int, int, int]] = []         # (source, offset, bytes, area offset)
    device: list[tuple[Source, memoryview]] = []
    staged: list[Source] = []
    pos = start
    for s in sources:
        view = lease.view[pos:pos + s.nbytes]
        if s.device_bytes is not None:
            device.append((s, view))
        else:
            for off in range(0, s.nbytes, COPY_CHUNK):
                tasks.append((s, off, min(COPY_CHUNK, s.nbytes - off), pos + off))
        if s.kind == "stream":
            staged.append(Source(s.name, s.nbytes, s.kind, s.dtype, s.shape, None, None, _StagedStream(view),
                                 (s.nbytes, None)))
        else:
            staged.append(Source(s.name, s.nbytes, s.kind, s.dtype, s.shape, view, lease.address + pos, view,
                                 (s.nbytes, None)))
        pos += s.nbytes
    ctypes.memset(lease.address + pos, 0, _aligned(pos) - pos)
    if device:
        lease.area.pin()
        copy_from_device([(s.device_bytes, v) for s, v in device])
    _run_copies(tasks, lease, copy_threads)
    for s in sources:
        why = s.changed()
        if why:
            raise IntegrityError(f"{why}; nothing was committed. Keep buffers unchanged until the save has "
                                 "snapshotted them (async) or finished (zero-copy, handle.wait())")
    return staged


def _copy_one(task: tuple[Source, int, int, int], lease: Lease) -> None:
    s, off, n, at = task
    s.copy_into(off, lease.view[at:at + n], lease.address + at)


_copiers: dict[int, ThreadPoolExecutor] = {}  # by size; kept: starting threads in the blocked window costs
_copiers_lock = threading.Lock()


def _copier(nthreads: int) -> ThreadPoolExecutor:
    with _copiers_lock:
        ex = _copiers.get(nthreads)
        if ex is None:
            ex = _copiers[nthreads] = ThreadPoolExecutor(max_workers=nthreads, thread_name_prefix="ckpt-stage")
        return ex


def _run_copies(tasks: list[tuple[Source, int, int, int]], lease: Lease, copy_threads: int | None) -> None:
    nthreads = max(1, min(copy_threads or (os.cpu_count() or 1), 8, len(tasks)))
    # Largest pieces first, handed out one at a time: the threads finish together.
    parallel(sorted(tasks, key=lambda t: -t[2]), lambda t: _copy_one(t, lease), nthreads)


def parallel(items: list[Any], fn: Callable[[Any], object], nthreads: int) -> None:
    """fn(item) for every item, in order, handed out one at a time to `nthreads` threads (the
    caller's among them; the others from a kept executor); the first error is raised here."""
    nthreads = max(1, min(nthreads, len(items)))
    if nthreads == 1:
        for item in items:
            fn(item)
        return
    it = iter(items)
    lock = threading.Lock()
    errors: list[BaseException] = []

    def work() -> None:
        while not errors:
            with lock:
                item = next(it, None)
            if item is None:
                return
            try:
                fn(item)
            except BaseException as e:  # noqa: BLE001 - re-raised in the caller's thread
                errors.append(e)

    ex = _copier(nthreads - 1)
    helpers = [ex.submit(work) for _ in range(nthreads - 1)]
    work()
    for h in helpers:
        h.result()
    if errors:
        raise errors[0]


def memmove_all(copies: list[tuple[int, int, int]], nthreads: int) -> None:
    """(destination address, source address, bytes) copies, split into COPY_CHUNK pieces, largest
    first, on `nthreads` threads: ctypes.memmove releases the GIL, so they run in parallel."""
    pieces = [(d + o, s + o, min(COPY_CHUNK, n - o)) for d, s, n in copies for o in range(0, n, COPY_CHUNK)]
    pieces.sort(key=lambda p: -p[2])
    parallel(pieces, lambda p: ctypes.memmove(p[0], p[1], p[2]), nthreads)
