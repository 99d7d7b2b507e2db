"""Reusable host memory for saves: a pool of page-aligned blocks.

A synchronous save streams through a small pool (io.sync_buffer_bytes), so it adds bounded
memory, never the checkpoint's size. An async save snapshots into the staging pool
(io.staging_bytes) and returns once the last byte is copied in. Pools are allocated once per
process and size, pre-faulted (first-touch page faults cost more than the copy itself), and
reused by every later save. Blocks are page aligned, as O_DIRECT requires.
"""
from __future__ import annotations

import ctypes
import errno
import mmap
import threading
from collections import deque

from tiered_ckpt.errors import ConfigError

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
        self._mem = mmap.mmap(-1, self.nblocks * block_size, flags=flags)   # OSError(ENOMEM): see pool()
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
    "staging": "io.staging_bytes (or options=IoOptions(staging_bytes=...))",
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
