"""Conversions between a tiered DCP checkpoint and PyTorch's stock formats (`tiered-ckpt convert`).

* `to_dcp`: a committed checkpoint -> a stock DCP directory (what FileSystemWriter writes:
  ``.metadata`` + ``__0_<i>.distcp`` files with every tensor as torch.save bytes), which
  FileSystemReader, ``dcp.load(checkpoint_id=DIR)``, ``_load_state_dict_from_keys`` and
  ``format_utils.dcp_to_torch_save`` read. Streamed item by item (memory: the largest item);
  the metadata's state_dict_metadata and planner_data are kept, so DCP reshards it as before.
* `to_torch`: a committed checkpoint -> one torch.save file of the whole state (what
  ``format_utils.dcp_to_torch_save`` makes of a stock directory; needs the state in memory).
* `from_dcp`: a stock DCP directory (FileSystemWriter's) -> a committed checkpoint of a model,
  saved through TieredWriter (migration; needs the state in memory).

Why a converter and not a stock-named ``.metadata`` in every checkpoint: TieredWriter stores
tensors as raw bytes (what lets the reader read straight into the destination), and
FileSystemReader torch.load()s every tensor item; and ``.metadata`` would be the same name in
every save of a checkpoint name, against the commit protocol's unique names (docs/training.md).
Torch is imported here only (like tiered_ckpt.dcp).
"""
from __future__ import annotations

import io
import os
import pickle
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import MetadataIndex, StorageMeta, TensorStorageMetadata
from torch.distributed.checkpoint.state_dict_loader import _load_state_dict
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

from tiered_ckpt.dcp import DCP_VERSION, TieredReader, TieredWriter, _locations
from tiered_ckpt.errors import IntegrityError, UserError
from tiered_ckpt.io import fsafe
from tiered_ckpt.io.posix import os_error

__all__ = ["from_dcp", "to_dcp", "to_torch"]

Progress = Callable[[int], None]
STOCK_METADATA = ".metadata"        # DCP's filesystem._metadata_fn


def _empty_dir(dest: Path, flag: str) -> None:
    """`dest` created (parents too) and empty: a conversion never mixes into other files."""
    try:
        dest.mkdir(parents=True, exist_ok=True)
        if not fsafe.is_real_dir(dest):
            raise UserError(f"{flag} {dest}: not a directory (or a symlink); pass a new directory")
        if any(dest.iterdir()):
            raise UserError(f"{flag} {dest} is not empty; pass a new or empty directory (nothing was written)")
    except OSError as e:
        raise os_error(e, dest) from None


def to_dcp(reader: TieredReader, dest: str | os.PathLike[str], progress: Progress | None = None) -> dict[str, Any]:
    """Write the checkpoint `reader` names as a stock DCP directory at `dest` (module doc)."""
    md = reader.checked_metadata()            # marker and sizes checked (hashes with verify_hash=True)
    locs = _locations(md)
    out_dir = Path(dest)
    _empty_dir(out_dir, "--to dcp")
    names = {p: f"__0_{i}.distcp" for i, p in enumerate(sorted({loc.relative_path for loc in locs.values()}))}
    storage: dict[MetadataIndex, _StorageInfo] = {}
    outs: dict[str, Any] = {}
    ins: dict[str, int] = {}
    written = 0
    try:
        for index, loc in sorted(locs.items(), key=lambda kv: (kv[1].relative_path, kv[1].offset)):
            if loc.relative_path not in ins:
                ins[loc.relative_path] = fsafe.open_file(reader.path / loc.relative_path, anchor=reader.root)
                outs[loc.relative_path] = open(out_dir / names[loc.relative_path], "xb")  # noqa: SIM115 - closed below
            data = os.pread(ins[loc.relative_path], loc.length, loc.offset)
            if len(data) != loc.length:
                raise IntegrityError(f"{reader.path / loc.relative_path}: {loc.length} bytes expected at offset "
                                     f"{loc.offset}, {len(data)} there; restore the checkpoint (tiered-ckpt restore)")
            if loc.dtype is not None and isinstance(md.state_dict_metadata.get(index.fqn), TensorStorageMetadata):
                assert loc.shape is not None
                t = torch.frombuffer(bytearray(data), dtype=getattr(torch, loc.dtype)) if loc.length else \
                    torch.empty(0, dtype=getattr(torch, loc.dtype))
                buf = io.BytesIO()
                torch.save(t.reshape(loc.shape), buf)
                data = buf.getvalue()
            f = outs[loc.relative_path]
            storage[index] = _StorageInfo(names[loc.relative_path], f.tell(), len(data))
            f.write(data)
            written += len(data)
            if progress is not None:
                progress(loc.length)
        for f in outs.values():
            f.flush()
            os.fsync(f.fileno())
    except OSError as e:
        raise os_error(e, out_dir) from None
    finally:
        for fd in ins.values():
            os.close(fd)
        for f in outs.values():
            f.close()
    missing = sorted({i.fqn for i in md.storage_data or {}} - {i.fqn for i in storage})
    if missing:
        raise IntegrityError(f"{reader.path}: DCP metadata has no valid location for {missing[:3]}; restore the "
                             "checkpoint from the archive (tiered-ckpt restore)")
    sm = StorageMeta(checkpoint_id=str(out_dir), save_id=getattr(md.storage_meta, "save_id", None))
    meta = pickle.dumps(replace(md, storage_data=storage, storage_meta=sm, version=DCP_VERSION))
    try:
        fsafe.write_file(out_dir / STOCK_METADATA, meta, exclusive=True)
    except OSError as e:
        raise os_error(e, out_dir / STOCK_METADATA) from None
    return {"source": str(reader.path), "dest": str(out_dir), "format": "dcp", "items": len(storage),
            "files": len(names) + 1, "bytes": written + len(meta)}


@contextmanager
def _first_failure(what: str) -> Iterator[None]:
    """DCP wraps every rank's error in a CheckpointException (a BaseException): the first one, as itself
    when it is one of ours, else one UserError line."""
    try:
        yield
    except CheckpointException as e:
        first: BaseException = next(iter(e.failures.values()), (e,))[0]
        if isinstance(first, UserError):
            raise type(first)(str(first), exit_code=first.exit_code) from None
        raise UserError(f"{what}: {type(first).__name__}: {first}") from None


def _whole_state(reader: Any) -> dict[str, Any]:
    sd: dict[str, Any] = {}
    with _first_failure(f"cannot read {getattr(reader, 'path', reader)}"):
        _load_state_dict(sd, storage_reader=reader, planner=_EmptyStateDictLoadPlanner(), no_dist=True)
    return sd


def to_torch(reader: TieredReader, dest: str | os.PathLike[str]) -> dict[str, Any]:
    """Write the whole state of the checkpoint `reader` names as one torch.save file (module doc)."""
    out = Path(dest)
    if out.exists() or out.is_symlink():
        raise UserError(f"--to torch {out} exists; pass a new file name (nothing was written)")
    reader.checked_metadata()                 # the checkpoint's own error, not DCP's wrapper
    sd = _whole_state(reader)
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        with open(out, "xb") as f:
            torch.save(sd, f)
            f.flush()
            os.fsync(f.fileno())
    except OSError as e:
        raise os_error(e, out) from None
    return {"source": str(reader.path), "dest": str(out), "format": "torch", "items": len(sd),
            "bytes": out.stat().st_size}


def from_dcp(source: str | os.PathLike[str], writer: TieredWriter) -> dict[str, Any]:
    """Save the stock DCP directory `source` (FileSystemWriter's) as the checkpoint `writer` names."""
    src = Path(source)
    if not (src / STOCK_METADATA).is_file():
        raise UserError(f"--from dcp {src}: no {STOCK_METADATA} there; pass a directory that "
                        "torch.distributed.checkpoint's FileSystemWriter wrote")
    sd = _whole_state(FileSystemReader(src))
    with _first_failure(f"cannot save {writer.path}"):
        dcp_save(sd, storage_writer=writer, no_dist=True)
    m = writer.path
    return {"source": str(src), "dest": str(m), "format": "tiered", "items": len(sd)}
