"""The inline content hash of checkpoint files (xxh3-128, from the xxhash library)."""
from __future__ import annotations

import os
from typing import BinaryIO

import xxhash

from tiered_ckpt.io import fsafe

ALGORITHM = "xxh3_128"


def new_hasher() -> xxhash.xxh3_128:
    return xxhash.xxh3_128()


def hash_file(f: BinaryIO, chunk: int = 8 << 20) -> str:
    """Hex xxh3-128 of the rest of an open binary file."""
    h = new_hasher()
    buf = bytearray(chunk)
    view = memoryview(buf)
    while True:
        n = f.readinto(view)  # type: ignore[attr-defined]
        if not n:
            break
        h.update(view[:n])
    return h.hexdigest()


def hash_path(path: str, chunk: int = 8 << 20, *, anchor: str | os.PathLike[str] | None = None) -> str:
    """Hex xxh3-128 of a regular file, opened through fsafe: a symlink (below `anchor`, or the
    file itself without one), a FIFO or a device raises fsafe.UnsafePath instead of being read."""
    fd = fsafe.open_file(path, os.O_RDONLY, anchor=anchor)
    with os.fdopen(fd, "rb", buffering=0) as f:
        return hash_file(f, chunk)
