"""Which pages of a file are in the page cache: mincore(2) on a read-only mapping of it.

A load reads with O_DIRECT because a cold read then goes device -> destination with no page
cache in between; but a file that is already cached (a restart on the node that just wrote
or read it) is served from memory by a buffered read several times faster than the device,
while O_DIRECT would read it from the device again. io/fill.py asks here per read request.

mincore(2) reports, for a mapping of a file, which of its pages are resident in the page
cache; mapping the file does not read it (no page is faulted in). Its vector's bytes have the
least significant bit set for a resident page (the other bits are reserved).
"""
from __future__ import annotations

import ctypes
import ctypes.util
import mmap

from tiered_ckpt.io.posix import ALIGN

_libc: ctypes.CDLL | None = None
_MAP_FAILED = ctypes.c_void_p(-1).value
_LSB = bytes(i & 1 for i in range(256))      # a vector byte's other bits are reserved


def _lib() -> ctypes.CDLL | None:
    global _libc
    if _libc is None:
        try:
            lib = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
            lib.mmap.restype = ctypes.c_void_p
            lib.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                                 ctypes.c_long]
            lib.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
            lib.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
        except (OSError, AttributeError):
            return None
        _libc = lib
    return _libc


def resident(fd: int, size: int) -> bytes | None:
    """One byte per 4 KiB page of the file's first `size` bytes, 1 where the page is cached;
    None where this cannot be told (no mincore, a file that cannot be mapped): treat as cold."""
    if size <= 0 or ALIGN != mmap.PAGESIZE:
        return None
    lib = _lib()
    if lib is None:
        return None
    addr = lib.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
    if addr is None or addr == _MAP_FAILED:
        return None
    try:
        vec = ctypes.create_string_buffer(-(-size // ALIGN))
        if lib.mincore(addr, size, vec) != 0:
            return None
        return vec.raw.translate(_LSB)
    finally:
        lib.munmap(addr, size)


def cached_fraction(vec: bytes | None, off: int, n: int) -> float:
    """The fraction of the pages of file bytes off..off+n that `vec` (from `resident`) marks cached."""
    if vec is None or n <= 0:
        return 0.0
    a, b = off // ALIGN, -(-(off + n) // ALIGN)
    part = vec[a:b]
    return (len(part) - part.count(0)) / len(part) if part else 0.0

