"""An AsyncStager for `dcp.async_save`: stages into a reusable, bounded staging pool.

    import torch.distributed.checkpoint as dcp
    from tiered_ckpt.dcp import TieredWriter
    from tiered_ckpt.dcp_stage import TieredStager

    stager = TieredStager(budget_bytes=8 << 30)          # once, reused by every save
    fut = dcp.async_save(state, storage_writer=TieredWriter(root, model, epoch=e, step=s), async_stager=stager)
    ...                                                   # train on: `state` may change now
    fut.result()                                          # committed (or raises)

`stage` copies every tensor of the state (DTensor: its local shard; CUDA tensors device to host)
into one extent of the stager's pool and returns a copy of the state made of views of it; non-
tensor values are deep-copied. `async_save` returns once that copy is done. The pool is page-
aligned host memory, pinned when CUDA is available (device-to-host copies run at full speed and
asynchronously), in shared memory with ``share_memory=True`` (what
``async_checkpointer_type=AsyncCheckpointerType.PROCESS`` needs: DCP pickles the staged state to
its background process, and shared storages travel as handles instead of copies). It is made
once, sized to the state being saved, and reused by later saves; `close()` gives back the
memory no save holds (DCP calls it when its checkpointer closes; call it to free the staging
between saves). `pool_bytes` and `peak_bytes` say what it holds.

Host tensors are copied with GIL-free memmoves on `threads` threads (default io.threads, at most
one per core: the copy floor is a multi-core memcpy, not one thread's). CUDA tensors are copied
on a side stream per device (non_blocking, into pinned memory), which first waits for the device's current stream; `stage` returns once an event recorded after the
last copy completed, so the caller may change its tensors right away.

Memory budget (``budget_bytes``, default the node config's io.staging_bytes, 4 GiB): the pool
never holds more. An extent is freed when this process's TieredWriter has written the save
(thread mode), or when DCP has dropped the staged state (the save ended: process mode, other
writers); a save that needs more than is free waits for earlier saves to free theirs (up to
``timeout`` seconds, then a clear error). A state larger than the whole budget is staged in part
(largest tensors first, up to the budget); the rest is not copied, and `async_save` returns only
once this rank has written it (DCP calls `synchronize_staging`): the save waits instead of growing
the pool. In process mode that case is refused (the background process would read the live
tensors after `async_save` returned): raise the budget.

Torch is imported here only (like tiered_ckpt.dcp).
"""
from __future__ import annotations

import copy
import ctypes
import gc
import logging
import os
import threading
import time
import weakref
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.distributed.checkpoint.staging import AsyncStager

from tiered_ckpt.config import IoConfig
from tiered_ckpt.errors import UserError
from tiered_ckpt.io import pools, sources
from tiered_ckpt.io.pools import ALIGN

__all__ = ["TieredStager", "addresses", "notify_written"]

log = logging.getLogger(__name__)


def _aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


class _Chunk:
    """One allocation of the pool: a flat uint8 tensor with a first-fit list of free extents."""

    def __init__(self, nbytes: int, pin: bool, share: bool) -> None:
        self.nbytes = nbytes
        if share:
            storage = torch.UntypedStorage._new_shared(nbytes)
            self.base = torch.empty(0, dtype=torch.uint8).set_(storage)
            if pin:
                import torch.cuda._pin_memory_utils as pin_utils

                pin_utils.pin_memory(self.base.data_ptr(), nbytes)
                fin = weakref.finalize(storage, pin_utils.unpin_memory, self.base.data_ptr())
                fin.atexit = False     # not after the CUDA context is gone
        else:
            # Started on a page (torch.empty's memory starts 64 bytes into one): the writer's
            # O_DIRECT writes go straight from the staged tensors (io/pipeline.py).
            raw = torch.empty(nbytes + ALIGN, dtype=torch.uint8, pin_memory=pin)
            shift = -raw.data_ptr() % ALIGN
            self.base = raw[shift:shift + nbytes]
        self.address = self.base.data_ptr()
        self.free: list[tuple[int, int]] = [(0, nbytes)]     # (offset, length), sorted by offset

    def take(self, n: int) -> int | None:
        for i, (off, length) in enumerate(self.free):
            if length >= n:
                if length == n:
                    self.free.pop(i)
                else:
                    self.free[i] = (off + n, length - n)
                return off
        return None

    def give(self, off: int, n: int) -> None:
        self.free.append((off, n))
        self.free.sort()
        merged: list[tuple[int, int]] = []
        for o, length in self.free:
            if merged and merged[-1][0] + merged[-1][1] == o:
                merged[-1] = (merged[-1][0], merged[-1][1] + length)
            else:
                merged.append((o, length))
        self.free = merged

    @property
    def idle(self) -> bool:
        return self.free == [(0, self.nbytes)]


@dataclass(eq=False)
class _Ticket:
    """One save's hold on the pool: its extent, and the memory a writer reports as written."""

    regions: list[tuple[int, int]]          # [start, end) addresses of staged and live tensors
    release: Any                            # frees the extent (idempotent)
    live: bool = False                      # part of the state was not copied: wait for the writer
    done: threading.Event = field(default_factory=threading.Event)


_tickets: list[_Ticket] = []
_tickets_lock = threading.Lock()


def notify_written(addresses: Iterable[int] = ()) -> None:
    """TieredWriter, after a rank's write_data (done or failed): the tensors at these addresses
    were read, so the saves they belong to no longer need their staging memory."""
    addrs = sorted(set(addresses))
    if not addrs:
        return
    with _tickets_lock:
        hit = [t for t in _tickets if any(a <= p < b for a, b in t.regions for p in _within(addrs, a, b))]
        for t in hit:
            _tickets.remove(t)
    for t in hit:
        t.release()
        t.done.set()


def addresses(obj: Any) -> list[int]:
    """Start addresses of the tensors in a (nested) state: a DTensor's local tensor, a
    ShardedTensor's local shards (FSDP1), a plain tensor; a tensor without storage of its own
    (a wrapper subclass, a meta tensor) has none and is skipped."""
    out: list[int] = []
    for t in _tensors(obj):
        for part in _parts(t):
            ptr = _data_ptr(part)
            if ptr:
                out.append(ptr)
    return out


def _data_ptr(t: torch.Tensor) -> int:
    """The tensor's start address, or 0 where it has no storage to point into."""
    try:
        return int(t.data_ptr())
    except (RuntimeError, TypeError, NotImplementedError):
        return 0


def _within(addrs: list[int], a: int, b: int) -> list[int]:
    import bisect

    i = bisect.bisect_left(addrs, a)
    return addrs[i:i + 1] if i < len(addrs) and addrs[i] < b else []


class TieredStager(AsyncStager):
    """Stages a state into a reusable pool of at most `budget_bytes` (module doc)."""

    _synchronize_after_execute = True

    def __init__(self, budget_bytes: int | None = None, *, pin_memory: bool | None = None, share_memory: bool = False,
                 timeout: float = 600.0, threads: int | None = None) -> None:
        budget = IoConfig().staging_bytes if budget_bytes is None else budget_bytes
        # Host tensors are copied by this many threads (GIL-free memmoves), at most one per core.
        self.threads = max(1, min(threads or IoConfig().threads, os.cpu_count() or 1))
        if not isinstance(budget, int) or budget < ALIGN:
            raise UserError(f"TieredStager(budget_bytes={budget_bytes!r}): pass the staging memory in bytes, at least "
                            f"{ALIGN} (e.g. budget_bytes=8 << 30)")
        self.budget = budget
        self.pin = torch.cuda.is_available() if pin_memory is None else bool(pin_memory and torch.cuda.is_available())
        self.share = share_memory
        self.timeout = timeout
        self._chunks: list[_Chunk] = []
        self._cond = threading.Condition()
        self._waiting: list[_Ticket] = []
        # Extents given back, applied under the lock by the next allocation: a release may run in
        # a weakref finalizer, i.e. inside any allocation of any thread, even one holding the lock.
        self._returns: deque[tuple[_Chunk, int, int]] = deque()
        self.peak_bytes = 0          # the most the pool ever held (never above the budget)

    @property
    def pool_bytes(self) -> int:
        return sum(c.nbytes for c in list(self._chunks))

    # -- AsyncStager ---------------------------------------------------------------------
    @torch.no_grad()
    def stage(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        leaves = list(_tensors(state_dict))
        by_id: dict[int, torch.Tensor] = {}
        for t in leaves:
            by_id.setdefault(id(t), t)
        for t in by_id.values():
            _require_stageable(t)
        sizes = {i: sum(_aligned(p.numel() * p.element_size()) for p in _parts(t)) for i, t in by_id.items()}
        # Largest first up to the budget; what does not fit stays live (the save then waits).
        staged_ids: list[int] = []
        room = self.budget
        for i in sorted(sizes, key=lambda i: -sizes[i]):
            if sizes[i] <= room:
                staged_ids.append(i)
                room -= sizes[i]
        staged_set = set(staged_ids)
        live_ids = [i for i in sizes if i not in staged_set]
        if live_ids and self.share:
            need = sum(sizes.values())
            raise UserError(f"the state to save needs {need} bytes of staging, more than TieredStager(budget_bytes="
                            f"{self.budget}); in process mode (share_memory=True) it must fit: raise budget_bytes, or "
                            "use AsyncCheckpointerType.THREAD (it waits for the rest to be written)")
        # One extent for the state; in shared memory each DTensor's shard gets its own (torch
        # 2.13 crashes pickling a DTensor whose local tensor starts inside a shared storage).
        groups: list[list[int]] = [[]]
        for i in staged_ids:
            if self.share and _is_dtensor(by_id[i]) and sizes[i]:
                groups.append([i])
            else:
                groups[0].append(i)
        extents: list[tuple[_Chunk | None, int, int]] = []
        memo: dict[int, Any] = {}
        regions: list[tuple[int, int]] = []
        side = _SideStreams(self.pin)
        host: list[tuple[int, int, int]] = []      # (staging address, tensor address, bytes)
        try:
            for group in sorted(groups, key=lambda g: -sum(sizes[i] for i in g)):
                total = sum(sizes[i] for i in group)
                chunk, off = self._allocate(total) if total else (None, 0)
                extents.append((chunk, off, total))
                pos = off
                for i in group:
                    t = by_id[i]
                    dsts = []
                    for src in _parts(t):
                        n = src.numel() * src.element_size()
                        if n:
                            assert chunk is not None
                            dst = chunk.base[pos:pos + n].view(src.dtype).view(src.shape)
                            regions.append((chunk.address + pos, chunk.address + pos + n))
                        else:
                            dst = torch.empty(src.shape, dtype=src.dtype)
                        if chunk is not None and _aligned(n) > n:
                            # The padding to the next page: an O_DIRECT write of an item's tail reads it.
                            ctypes.memset(chunk.address + pos + n, 0, _aligned(n) - n)
                        if n and src.device.type == "cpu" and src.is_contiguous():
                            host.append((dst.data_ptr(), src.data_ptr(), n))    # below, on several threads
                        else:
                            side.copy(dst, src.detach())
                        dsts.append(dst)
                        pos += _aligned(n)
                    memo[i] = _rewrap(t, dsts)
            pools.memmove_all(host, self.threads)
            side.wait()          # the device-to-host copies are complete before the caller changes its tensors
        except BaseException:
            side.wait()
            for chunk, off, total in extents:
                self._free(chunk, off, total)
            raise
        for i in live_ids:
            t = by_id[i]
            memo[i] = t
            for loc in _parts(t):
                ptr = _data_ptr(loc)
                regions.append((ptr, ptr + max(1, loc.numel() * loc.element_size())))
        staged = copy.deepcopy(state_dict, memo)
        if regions:
            ticket = self._ticket(extents, regions, bool(live_ids), [memo[i] for i in staged_ids])
            if ticket.live:
                self._waiting.append(ticket)
        return staged

    def synchronize_staging(self) -> None:
        """DCP calls this before async_save returns: for a state larger than the budget, wait
        until this rank has written what was not copied (the caller may change it afterwards)."""
        waiting, self._waiting = self._waiting, []
        for t in waiting:
            if not t.done.wait(self.timeout):
                log.warning("TieredStager: the save did not report its write within %s s; returning (if it still "
                            "runs, tensors changed from now on may be saved changed)", self.timeout)

    def close(self) -> None:
        with self._cond:
            self._apply_returns()
            self._chunks = [c for c in self._chunks if not c.idle]

    # -- the pool --------------------------------------------------------------------------
    def _allocate(self, n: int) -> tuple[_Chunk, int]:
        deadline = time.monotonic() + self.timeout
        collected = 0.0
        with self._cond:
            while True:
                self._apply_returns()
                for c in self._chunks:
                    off = c.take(n)
                    if off is not None:
                        return c, off
                # Idle chunks too small for this state give their memory back first.
                self._chunks = [c for c in self._chunks if not (c.idle and c.nbytes < n)]
                if self.pool_bytes + n <= self.budget:
                    try:
                        c = _Chunk(n, self.pin, self.share)
                    except RuntimeError as e:
                        raise UserError(f"cannot allocate {n} bytes of staging memory ({e}); lower "
                                        "TieredStager(budget_bytes=...) or free host memory") from None
                    self._chunks.append(c)
                    self.peak_bytes = max(self.peak_bytes, self.pool_bytes)
                    off = c.take(n)
                    assert off == 0
                    return c, off
                now = time.monotonic()
                if now >= deadline:
                    raise UserError(f"TieredStager: {n} bytes of staging needed, but earlier saves still hold "
                                    f"{self.pool_bytes} of budget_bytes={self.budget} after {self.timeout:g} s; "
                                    "wait for the previous async_save (its future's result()) or raise budget_bytes")
                if now - collected > 1.0:
                    # Staged copies that nothing references any more (a failed save's) free their extent.
                    self._cond.release()
                    try:
                        gc.collect()
                    finally:
                        self._cond.acquire()
                    collected = time.monotonic()
                self._cond.wait(0.05)

    def _free(self, chunk: _Chunk | None, off: int, n: int) -> None:
        if chunk is not None:
            self._returns.append((chunk, off, n))      # deque.append is atomic; no lock taken here

    def _apply_returns(self) -> None:
        while self._returns:
            chunk, off, n = self._returns.popleft()
            chunk.give(off, n)

    def _ticket(self, extents: list[tuple[_Chunk | None, int, int]], regions: list[tuple[int, int]], live: bool,
                staged: list[Any]) -> _Ticket:
        state: list[bool] = []

        # The staged extents stay unchanged until released: the TieredWriter's pipeline writes
        # their blocks straight from them (pipeline.py), no copy through its ring.
        tokens = [sources.hold_stable(chunk.address + off, n) for chunk, off, n in extents if chunk is not None and n]

        def release() -> None:
            if state:
                return
            state.append(True)      # list.append is atomic: an extent is given back once
            for token in tokens:
                sources.drop_stable(token)
            for chunk, off, n in extents:
                self._free(chunk, off, n)

        ticket = _Ticket(regions, release, live)
        with _tickets_lock:
            _tickets.append(ticket)
        # Also freed once every staged tensor is gone: DCP holds the staged state until the save ends.
        remaining = [len(staged)]

        def gone() -> None:
            remaining[0] -= 1
            if remaining[0] == 0:
                with _tickets_lock:
                    if ticket in _tickets:
                        _tickets.remove(ticket)
                release()

        for obj in staged:
            weakref.finalize(obj, gone)
        return ticket


class _SideStreams:
    """Device-to-host copies on a side stream per device, completed by one event each.

    Each side stream first waits for the device's current stream (pending writes to the
    tensors); the copies are non_blocking into pinned memory (asynchronous DMA) and the source
    tensors are recorded on the side stream, so the caching allocator keeps their memory until
    the copies ran (pytorch.org/docs/stable/notes/cuda.html#cuda-streams). Host tensors are
    copied at once (torch's CPU copy_ releases the GIL and uses the intra-op threads).
    """

    def __init__(self, pinned: bool) -> None:
        self.pinned = pinned
        self._streams: dict[torch.device, Any] = {}

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        if src.device.type != "cuda":
            dst.copy_(src)
            return
        side = self._streams.get(src.device)
        if side is None:
            side = self._streams[src.device] = torch.cuda.Stream(device=src.device)
            side.wait_stream(torch.cuda.current_stream(src.device))
        with torch.cuda.stream(side):
            dst.copy_(src, non_blocking=self.pinned)
        src.record_stream(side)

    def wait(self) -> None:
        streams, self._streams = self._streams, {}
        events = []
        for side in streams.values():
            ev = torch.cuda.Event()
            ev.record(side)
            events.append(ev)
        for ev in events:
            ev.synchronize()


def _is_dtensor(t: torch.Tensor) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)


def _is_sharded(t: torch.Tensor) -> bool:
    from torch.distributed._shard.sharded_tensor import ShardedTensor

    return isinstance(t, ShardedTensor)


def _parts(t: torch.Tensor) -> list[torch.Tensor]:
    """The tensors that hold this rank's bytes: a DTensor's local tensor, a ShardedTensor's
    local shards (FSDP1's sharded state dicts; none on a rank without a shard), else the tensor."""
    from torch.distributed.tensor import DTensor

    if isinstance(t, DTensor):
        return [t._local_tensor]
    if _is_sharded(t):
        return [s.tensor for s in t.local_shards()]  # type: ignore[attr-defined]
    return [t]


def _require_stageable(t: torch.Tensor) -> None:
    if _is_dtensor(t) or _is_sharded(t) or type(t) is torch.Tensor or isinstance(t, torch.nn.Parameter):
        return
    raise UserError(f"TieredStager cannot stage a {type(t).__name__} (a tensor subclass other than DTensor and "
                    "ShardedTensor); convert it (e.g. to a DTensor), save it with dcp.save (no stager), or use "
                    "DCP's DefaultStager")


def _rewrap(t: torch.Tensor, staged: list[torch.Tensor]) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    if isinstance(t, DTensor):
        # Same mesh, placements and global shape; the local shard now lives in host memory
        # (what DCP's own stager does; DCP writes DTensors shard by shard).
        return DTensor(staged[0], t._spec, requires_grad=False)
    if _is_sharded(t):
        from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor

        shards = [Shard(s, old.metadata) for s, old in zip(staged, t.local_shards(), strict=True)]  # type: ignore[attr-defined]
        return ShardedTensor._init_from_local_shards_and_global_metadata(  # type: ignore[no-any-return]
            shards, t.metadata(), process_group=t._process_group)  # type: ignore[attr-defined]
    return staged[0]


def _tensors(obj: Any) -> Iterable[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from _tensors(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from _tensors(v)
