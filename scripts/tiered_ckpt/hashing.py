"""The inline content hash of checkpoint files (xxh3-128, from the xxhash library)."""
from __future__ import annotations

from typing import BinaryIO

import xxhash

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


def hash_path(path: str, chunk: int = 8 << 20) -> str:
    with open(path, "rb", buffering=0) as f:
        return hash_file(f, chunk)
