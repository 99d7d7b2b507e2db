"""Reusable host memory for saves: a pool of page-aligned blocks.

A synchronous save streams through a small pool (io.sync_buffer_bytes), so it adds bounded
memory, never the checkpoint's size. An async save snapshots into the staging pool
(io.staging_bytes) and returns once the last byte is copied in. Pools are allocated once per
process and size, pre-faulted (first-touch page faults cost more than the copy itself), and
reused by every later save. Blocks are page aligned, as O_DIRECT requires.
"""
from __future__ import annotations

import ctypes
import mmap
import threading
from collections import deque

ALIGN = 4096


class Aborted(Exception):
    """The save using this pool failed; whoever waits for a block stops."""


class BlockPool:
    def __init__(self, total_bytes: int, block_size: int) -> None:
        block_size = max(ALIGN, block_size // ALIGN * ALIGN)
        if total_bytes < 2 * block_size:
            # Two blocks at least, so copying and writing overlap; shrink blocks to fit the budget.
            block_size = max(ALIGN, (total_bytes // 2) // ALIGN * ALIGN)
        self.block_size = block_size
        self.nblocks = max(2, total_bytes // block_size)
        flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | getattr(mmap, "MAP_POPULATE", 0)
        self._mem = mmap.mmap(-1, self.nblocks * block_size, flags=flags)
        self._view = memoryview(self._mem)
        self._base = ctypes.addressof(ctypes.c_char.from_buffer(self._mem))
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
            p = _pools[key] = BlockPool(total_bytes, block_size)
        return p
