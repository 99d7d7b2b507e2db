"""DCP's metadata is a pickle: verified against the marker, then unpickled with an allow-list.

Directories of the checkpoint tree are group-writable (2775, shared by the training users and
the retention user), so any member of the group can plant a file of the same size as
``dcp.<sid>.metadata``; `pickle.loads` of it would run whatever code it names (pickle docs:
"Warning: The pickle module is not secure"). Two layers, on every rank that unpickles:

1. every byte that is unpickled is hashed first (xxh3-128) and compared with the marker's
   hash of that file; a file the marker does not hash is refused;
2. the unpickler resolves only the classes DCP's Metadata is made of (the dataclasses of
   torch.distributed.checkpoint.metadata, FileSystemWriter's `_StorageInfo`, torch.Size, torch
   dtypes/layouts/memory formats, builtin containers), the way the pickle docs' "Restricting
   Globals" section does it (`Unpickler.find_class`); anything else is refused. The reader's
   own `tiered_ckpt.dcp._Stored` only in format-1 metadata (no `version`; format 2 on holds
   DCP's classes only, so that it unpickles without this package). A planted marker whose hash
   matches a planted pickle still runs nothing.

Item bytes that DCP's planner gives to ``torch.load(weights_only=False)`` (BYTE_IO items: a
non-tensor value, save_training's per-rank extras, Lightning's state) are covered by layer 1:
the verified metadata records each such item's hash (a ``tiered_ckpt.xxh3/<hex>`` transform
descriptor of its `_StorageInfo`: tiered_ckpt.dcp.DIGEST).
"""
from __future__ import annotations

import io
import pickle
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import Metadata

from tiered_ckpt.errors import IntegrityError
from tiered_ckpt.io.hashing import new_hasher

__all__ = ["check_hash", "load_metadata"]

_DCP_METADATA = "torch.distributed.checkpoint.metadata"
# (module, name) pairs DCP's Metadata pickles reference (torch 2.4-2.9: dataclasses, the
# memory-format enum TensorProperties pickles, torch.serialization's layout lookup).
_ALLOWED: frozenset[tuple[str, str]] = frozenset({
    (_DCP_METADATA, "Metadata"), (_DCP_METADATA, "MetadataIndex"), (_DCP_METADATA, "StorageMeta"),
    (_DCP_METADATA, "TensorStorageMetadata"), (_DCP_METADATA, "BytesStorageMetadata"),
    (_DCP_METADATA, "ChunkStorageMetadata"), (_DCP_METADATA, "TensorProperties"),
    (_DCP_METADATA, "_MEM_FORMAT_ENCODING"),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"), ("torch.serialization", "_get_layout"),
    ("builtins", "set"), ("builtins", "frozenset"), ("builtins", "complex"), ("builtins", "bytearray"),
    ("builtins", "slice"), ("collections", "OrderedDict"),
})
# Format-1 checkpoints (before DCP's own `_StorageInfo`) pickled the reader's location record.
_FORMAT_1: frozenset[tuple[str, str]] = frozenset({("tiered_ckpt.dcp", "_Stored")})
_TORCH_VALUES = (torch.dtype, torch.layout, torch.memory_format)


class _Restricted(pickle.Unpickler):
    format_1 = False        # whether a format-1 class was resolved (load_metadata checks the version)

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _ALLOWED:
            return super().find_class(module, name)
        if (module, name) in _FORMAT_1:
            self.format_1 = True
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), _TORCH_VALUES):
            return getattr(torch, name)       # torch.float32 etc. pickle as globals of torch
        raise pickle.UnpicklingError(f"it references {module}.{name}, which DCP metadata never holds")


def check_hash(data: bytes | memoryview, expected: str | None, path: Path, what: str) -> None:
    """IntegrityError unless `data` hashes to `expected` (the marker's / metadata's xxh3-128)."""
    if expected is None:
        raise IntegrityError(f"{path}: {what} has no content hash in the checkpoint's marker, so it cannot be "
                             "checked before it is unpickled; it is not loaded — save the checkpoint again")
    h = new_hasher()
    h.update(data)
    if h.hexdigest() != expected:
        raise IntegrityError(f"{path}: {what} does not match its content hash (changed or corrupted after commit; "
                             "it was not unpickled); restore the checkpoint from the archive (tiered-ckpt restore)")


def load_metadata(data: bytes, path: Path) -> Metadata:
    """DCP's Metadata from (already hashed) bytes: the allow-list, a Metadata object, and the
    format-1 record only in metadata without a format version (module doc)."""
    md, format_1 = _loads(data, path)
    if not isinstance(md, Metadata):
        raise IntegrityError(f"{path} is not DCP metadata; restore the checkpoint from the archive")
    if format_1 and getattr(md, "version", None) is not None:
        raise IntegrityError(f"{path} is not DCP metadata this toolkit wrote (version {md.version!r} with "
                             "format-1 records); it was refused — restore the checkpoint from the archive "
                             "(tiered-ckpt restore)")
    return md


def _loads(data: bytes, path: Path) -> tuple[Any, bool]:
    """Unpickled with only the allow-listed classes (module doc); and whether a format-1 one was among them."""
    u = _Restricted(io.BytesIO(data))
    try:
        return u.load(), u.format_1
    except (pickle.UnpicklingError, EOFError, AttributeError, ImportError, TypeError, ValueError, IndexError,
            KeyError) as e:
        raise IntegrityError(f"{path} is not DCP metadata this toolkit wrote ({e}); it was refused, not run — "
                             "restore the checkpoint from the archive (tiered-ckpt restore)") from None
