"""The I/O options of save / async_save / load: one frozen dataclass, documented per field.

    import tiered_ckpt as tc
    from tiered_ckpt.io.options import IoOptions

    fast = IoOptions(files=16, threads=16, hash=False)
    tc.save(state, epoch=3, step=12000, options=fast)
    tc.load(options=IoOptions(direct=False))

Precedence, per field: a value set in the `IoOptions` passed as ``options=`` wins; a field left
at ``None`` takes the node config's ``io`` section (``config=``, else the config file:
``$TIERED_CKPT_CONFIG`` or /etc/tiered-ckpt/config.yaml; a key missing there has the
`tiered_ckpt.config.IoConfig` default). Fields without a config key (hash, barrier_timeout,
copy_threads, overwrite_incomplete) have the defaults below.

`resolve` turns the options into `WriteOptions`: every value filled in and checked, what the
writer and reader run with.
"""
from __future__ import annotations

from dataclasses import dataclass

from tiered_ckpt.config import IoConfig
from tiered_ckpt.errors import UserError
from tiered_ckpt.io.pools import ALIGN


@dataclass(frozen=True)
class IoOptions:
    """How a save or load does its I/O. ``None``: the node config's io section decides."""

    files: int | None = None
    """Shard files per rank (save). Config: ``io.files_per_rank`` (default 8). One file per
    writer thread keeps as many Lustre OSTs busy."""

    threads: int | None = None
    """Writer threads (save) / reader threads (load), one file each at a time. Config:
    ``io.threads`` (default 8)."""

    block_size: int | None = None
    """Request size in bytes, a multiple of 4 KiB (O_DIRECT alignment). Config: ``io.block_size``
    (default 16 MiB; aligned requests of 4 MiB and more suit Lustre)."""

    direct: bool | None = None
    """O_DIRECT for data files (bypasses the page cache); file systems without it (tmpfs) fall
    back to buffered I/O, reported as ``SaveResult.direct``. Config: ``io.direct`` (default True)."""

    hash: bool = True
    """Hash every shard inline (xxh3-128) and record it in the marker (save). False saves the
    hashing CPU; `verify --hash` and restore can then check sizes only."""

    buffer_bytes: int | None = None
    """Memory a synchronous save (and a zero-copy async save) streams through. Config:
    ``io.sync_buffer_bytes`` (default 256 MiB)."""

    staging_bytes: int | None = None
    """The most host memory an async save's staging area may map (it maps what the save needs,
    no more); a checkpoint that needs more streams through this much. Config:
    ``io.staging_bytes`` (default 4 GiB)."""

    barrier_timeout: float = 600.0
    """Seconds ranks wait for each other at each agreement (torch.distributed collectives, or
    rank 0 waiting for every part manifest in file mode) before the save fails on every rank."""

    copy_threads: int | None = None
    """Threads copying buffers into the pool (GIL-free memmove). None: one per core, at most 8."""

    overwrite_incomplete: bool = True
    """Replace an earlier, never-committed save of the same name (a crashed attempt). False
    refuses with ConflictError instead. A committed checkpoint is never overwritten either way."""

    def resolve(self, io: IoConfig) -> WriteOptions:
        """These options with every ``None`` taken from `io`, checked (UserError naming the field)."""
        opts = WriteOptions(
            files=self.files or io.files_per_rank, threads=self.threads or io.threads,
            block_size=self.block_size or io.block_size, direct=io.direct if self.direct is None else self.direct,
            hash=self.hash, barrier_timeout=self.barrier_timeout, copy_threads=self.copy_threads,
        )
        if opts.block_size % ALIGN or opts.files < 1 or opts.threads < 1:
            raise UserError(f"files={opts.files}, threads={opts.threads}, block_size={opts.block_size}: need >= 1, >= 1 and a multiple of 4 KiB")
        return opts

    def pool_bytes(self, kind: str, io: IoConfig) -> int:
        """The size of the pool a save streams through: kind "staging" (async) or "sync"."""
        if kind == "staging":
            return self.staging_bytes if self.staging_bytes is not None else io.staging_bytes
        return self.buffer_bytes if self.buffer_bytes is not None else io.sync_buffer_bytes


@dataclass(frozen=True)
class WriteOptions:
    """IoOptions resolved against the node config: what the writer pipeline and the reader use."""

    files: int = 8
    threads: int = 8
    block_size: int = 16 << 20
    direct: bool = True
    hash: bool = True
    barrier_timeout: float = 600.0
    copy_threads: int | None = None     # default: one per core, at most 8
