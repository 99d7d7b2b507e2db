"""Turn what training code hands us (bytes, memoryview, numpy arrays, torch tensors, streams)
into flat byte sources, and back into objects on load.

Neither numpy nor torch is imported here unless the caller already uses them: a tensor or
array is recognised by its type's module and duck-typed attributes, so the node toolkit runs
without either installed.
"""
from __future__ import annotations

import ctypes
import itertools
import os
import sys
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from tiered_ckpt.errors import UserError
from tiered_ckpt.io.posix import ALIGN


@runtime_checkable
class StreamSource(Protocol):
    """A source too large (or too synthetic) to be one buffer: bytes are copied out on demand."""

    nbytes: int

    def copy_into(self, offset: int, out: memoryview) -> None: ...


@dataclass
class Source:
    """One named buffer as a flat run of bytes."""

    name: str
    nbytes: int
    kind: str                      # bytes | numpy | torch | stream
    dtype: str | None
    shape: list[int] | None
    view: memoryview | None        # flat 'B' view when the bytes are in memory
    address: int | None            # start address, for a GIL-free memmove
    obj: Any                       # the caller's object: kept alive, re-checked for resizes
    signature: tuple[int, int | None]
    device_bytes: Any = None       # flat uint8 view of a tensor in device (GPU) memory

    def copy_into(self, offset: int, out: memoryview, out_address: int | None = None) -> None:
        n = len(out)
        if self.device_bytes is not None:
            import torch

            torch.frombuffer(out, dtype=torch.uint8).copy_(self.device_bytes[offset:offset + n])
        elif self.kind == "stream":
            self.obj.copy_into(offset, out)
        elif self.address is not None and out_address is not None:
            # ctypes releases the GIL around memmove, so copies overlap with hashing threads.
            ctypes.memmove(out_address, self.address + offset, n)
        else:
            assert self.view is not None
            out[:n] = self.view[offset:offset + n]

    def changed(self) -> str | None:
        """Why the caller's object no longer matches what was planned, or None."""
        now = signature(self.obj)
        if now[0] != self.signature[0]:
            return f"buffer {self.name!r} changed size from {self.signature[0]} to {now[0]} bytes during the save"
        if now[1] != self.signature[1]:
            return f"buffer {self.name!r} was reallocated (moved in memory) during the save"
        return None


# Memory whose bytes stay unchanged until the save writing them ends: staging copies (the async
# staging area's lease, TieredStager's extents). The write pipeline writes a block straight from
# such memory (O_DIRECT from the staged bytes, hashed there) instead of copying it into its ring.
_stable: dict[int, tuple[int, int]] = {}
_stable_lock = threading.Lock()
_stable_ids = itertools.count(1)


def hold_stable(address: int, nbytes: int) -> int:
    """Declare [address, address + nbytes) staged, unchanged until drop_stable(token): the token."""
    token = next(_stable_ids)
    with _stable_lock:
        _stable[token] = (address, address + nbytes)
    return token


def drop_stable(token: int) -> None:
    with _stable_lock:
        _stable.pop(token, None)


def is_stable(address: int, nbytes: int) -> bool:
    """Whether [address, address + nbytes) lies in one region declared by hold_stable."""
    with _stable_lock:
        return any(a <= address and address + nbytes <= b for a, b in _stable.values())


def pin_host(address: int, nbytes: int) -> Callable[[], None] | None:
    """Page-lock host memory for device-to-host copies (cudaHostRegister, CUDA runtime API):
    the unpin function, or None without CUDA or when the driver refuses (the copies then still
    work, staged through the driver's own pinned buffer, at a lower rate)."""
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_available():
        return None
    cudart = torch.cuda.cudart()
    if int(cudart.cudaHostRegister(address, nbytes, 1)) != 0:     # 1: cudaHostRegisterPortable
        return None

    def unpin() -> None:
        cudart.cudaHostUnregister(address)

    return unpin


def copy_from_device(pairs: list[tuple[Any, memoryview]]) -> None:
    """Copy flat uint8 device tensors into host views, on a side stream, and wait for them.

    The side stream first waits for the caller's current stream (the tensors' pending writes);
    the copies are non_blocking (asynchronous into pinned pages), and one event synchronised at
    the end makes them complete before the caller may change its tensors and before anything
    writes the host bytes (CUDA semantics: pytorch.org/docs/stable/notes/cuda.html#cuda-streams).
    """
    import torch

    by_device: dict[Any, list[tuple[Any, memoryview]]] = {}
    for src, out in pairs:
        by_device.setdefault(src.device, []).append((src, out))
    events = []
    for device, items in by_device.items():
        with torch.cuda.device(device):
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for src, out in items:
                    if len(out):
                        torch.frombuffer(out, dtype=torch.uint8).copy_(src, non_blocking=True)
                        src.record_stream(side)      # the allocator keeps its memory until the copy ran
            ev = torch.cuda.Event()
            ev.record(side)
            events.append(ev)
    for ev in events:
        ev.synchronize()


# ctypes array types by size, for byte_view (bounded: a state may have many distinct sizes).
_BYTE_ARRAYS: dict[int, Any] = {}


def byte_view(address: int, nbytes: int) -> memoryview:
    """A writable flat 'B' view of `nbytes` at `address`, memory the caller keeps alive (the tensor
    is held beside the view). Per tensor ~1.5 us, where torch's `.view(uint8).numpy()` costs ~10 us:
    a second per 100k items of a DCP save or load."""
    typ = _BYTE_ARRAYS.get(nbytes)
    if typ is None:
        typ = ctypes.c_ubyte * nbytes
        if len(_BYTE_ARRAYS) < 4096:
            _BYTE_ARRAYS[nbytes] = typ
    return memoryview(typ.from_address(address)).cast("B")


def _is_torch(obj: Any) -> bool:
    return type(obj).__module__.startswith("torch") and hasattr(obj, "untyped_storage") and "torch" in sys.modules


def _is_numpy(obj: Any) -> bool:
    return hasattr(obj, "__array_interface__") and hasattr(obj, "dtype") and hasattr(obj, "flags")


def signature(obj: Any) -> tuple[int, int | None]:
    """(bytes, address) of a buffer now; used to detect resizes during a save."""
    if _is_torch(obj):
        return int(obj.numel() * obj.element_size()), int(obj.data_ptr())
    if _is_numpy(obj):
        return int(obj.nbytes), int(obj.__array_interface__["data"][0])
    if isinstance(obj, StreamSource):
        return int(obj.nbytes), None
    with memoryview(obj) as mv:
        return mv.nbytes, None


def _address(mv: memoryview, obj: Any) -> int | None:
    if not mv.readonly:
        return ctypes.addressof(ctypes.c_char.from_buffer(mv))
    if isinstance(obj, bytes):
        # c_char_p of a bytes object points at its own storage (no copy).
        return ctypes.cast(ctypes.c_char_p(obj), ctypes.c_void_p).value
    return None


def to_source(name: str, obj: Any) -> Source:
    if not isinstance(name, str) or not name:
        raise UserError(f"checkpoint keys must be non-empty strings; got {name!r}")
    if _is_torch(obj):
        import torch  # already imported by the caller (checked by _is_torch)

        t = obj.detach()
        if not t.is_contiguous():
            raise UserError(f"tensor {name!r} is not contiguous; save tensor.contiguous() instead")
        if t.device.type != "cpu":
            # Device memory is copied block by block straight into the pool (bounded host memory;
            # for an async save this device-to-host copy is the snapshot).
            return Source(name, int(t.numel() * t.element_size()), "torch", str(obj.dtype).removeprefix("torch."),
                          list(obj.shape), None, None, obj, signature(obj), t.reshape(-1).view(torch.uint8))
        addr = int(obj.data_ptr())     # = signature(obj), without its type checks (per-tensor cost)
        n = int(t.numel() * t.element_size())
        mv = byte_view(addr, n)        # the Source holds obj, whose memory this is
        return Source(name, n, "torch", str(obj.dtype).removeprefix("torch."), list(obj.shape), mv, addr, obj, (n, addr))
    if _is_numpy(obj):
        if obj.dtype.hasobject:
            raise UserError(f"array {name!r} holds Python objects (dtype {obj.dtype}); only plain numeric arrays can be saved")
        if not obj.flags.c_contiguous:
            raise UserError(f"array {name!r} is not C-contiguous; save numpy.ascontiguousarray(...) of it instead")
        flat = obj.reshape(-1).view("u1")
        mv = memoryview(flat)
        return Source(name, mv.nbytes, "numpy", obj.dtype.str, list(obj.shape), mv,
                      int(obj.__array_interface__["data"][0]), obj, signature(obj))
    if isinstance(obj, StreamSource):
        return Source(name, int(obj.nbytes), "stream", None, None, None, None, obj, signature(obj))
    if isinstance(obj, str):
        raise UserError(f"value of {name!r} is a str; encode it to bytes first")
    try:
        mv = memoryview(obj)
    except TypeError:
        raise UserError(
            f"value of {name!r} ({type(obj).__name__}) is not a buffer; pass bytes, memoryview, a numpy array or a torch "
            "tensor (nested in dicts/lists, with int/float/bool/str/None values, if need be)"
        ) from None
    if not mv.c_contiguous:
        raise UserError(f"buffer {name!r} is not contiguous; pass a contiguous copy")
    flat_mv = mv.cast("B") if (mv.ndim != 1 or mv.format != "B") else mv
    return Source(name, flat_mv.nbytes, "bytes", None, None, flat_mv, _address(flat_mv, obj), obj, (flat_mv.nbytes, None))


def to_sources(state: Mapping[str, Any]) -> list[Source]:
    if not isinstance(state, Mapping):
        raise UserError(f"save() takes a mapping of names to buffers; got {type(state).__name__}")
    return [to_source(k, v) for k, v in list(state.items())]


def writable_view(name: str, obj: Any) -> memoryview:
    """A flat writable byte view of a destination buffer for load(into=...)."""
    if _is_torch(obj):
        import torch

        if obj.device.type != "cpu" or not obj.is_contiguous():
            raise UserError(f"load into {name!r}: the tensor must be a contiguous CPU tensor")
        return memoryview(obj.reshape(-1).view(torch.uint8).numpy())
    if _is_numpy(obj):
        if not obj.flags.c_contiguous or not obj.flags.writeable:
            raise UserError(f"load into {name!r}: the array must be C-contiguous and writeable")
        return memoryview(obj.reshape(-1).view("u1"))
    try:
        mv = memoryview(obj)
    except TypeError:
        raise UserError(f"load into {name!r}: {type(obj).__name__} is not a writable buffer") from None
    if mv.readonly or not mv.c_contiguous:
        raise UserError(f"load into {name!r}: the buffer must be writable and contiguous (e.g. a bytearray)")
    return mv.cast("B") if (mv.ndim != 1 or mv.format != "B") else mv


def allocate(entry: Mapping[str, Any], residue: int | None = None) -> tuple[Any, memoryview]:
    """A new object shaped like a saved buffer (numpy/torch when they are installed) and its byte view.

    `residue`: the offset in its 4 KiB page the buffer's first byte should have (so that a file's
    pages land in it with O_DIRECT); honoured by over-allocating one page and starting the buffer
    inside it, where the element size allows (the tensor is then a view at that storage offset).
    """
    kind, nbytes = entry["kind"], int(entry["nbytes"])
    if kind == "torch":
        try:
            import torch
        except ImportError:
            kind = "numpy" if _numpy_dtype_ok(entry) else "bytes"
        else:
            dtype = getattr(torch, entry["dtype"])
            if not isinstance(dtype, torch.dtype):
                raise TypeError(f"{entry['dtype']!r} is not a torch dtype")
            t = None
            if residue is not None and nbytes and residue % dtype.itemsize == 0:
                raw = torch.empty(nbytes + ALIGN, dtype=torch.uint8)
                shift = (residue - raw.data_ptr()) % ALIGN
                if shift % dtype.itemsize == 0:
                    t = raw[shift:shift + nbytes].view(dtype).view(entry["shape"])
            if t is None:
                t = torch.empty(entry["shape"], dtype=dtype)
            return t, memoryview(t.reshape(-1).view(torch.uint8).numpy())  # type: ignore[arg-type]
    if kind == "numpy":
        try:
            import numpy as np
        except ImportError:
            kind = "bytes"
        else:
            dt = np.dtype(entry["dtype"])
            if residue is not None and nbytes and residue % dt.itemsize == 0:
                mem = np.empty(nbytes + ALIGN, dtype=np.uint8)
                at = (residue - mem.ctypes.data) % ALIGN
                if at % dt.itemsize == 0:
                    arr = mem[at:at + nbytes].view(dt).reshape(entry["shape"])
                    return arr, memoryview(mem[at:at + nbytes])  # type: ignore[arg-type]
            a = np.empty(entry["shape"], dtype=dt)
            return a, memoryview(a.reshape(-1).view(np.uint8))  # type: ignore[arg-type]
    b = bytearray(nbytes)
    return b, memoryview(b)


def _numpy_dtype_ok(entry: Mapping[str, Any]) -> bool:
    try:
        import numpy as np

        np.dtype(entry["dtype"])
        return True
    except (ImportError, TypeError):
        return False


class SyntheticSource:
    """Pseudo-random bytes of any size from a small pattern: the benchmark's checkpoint.

    The pattern length is not a multiple of the block size, so no two blocks are identical.
    """

    def __init__(self, nbytes: int, pattern_bytes: int = (8 << 20) + 4093, seed: int | None = None) -> None:
        import random

        self.nbytes = nbytes
        rnd = random.Random(seed)
        self._pattern = bytearray(rnd.randbytes(pattern_bytes)) * 2 if seed is not None else bytearray(os.urandom(pattern_bytes)) * 2
        self._plen = pattern_bytes
        self._addr = ctypes.addressof(ctypes.c_char.from_buffer(self._pattern))

    def copy_into(self, offset: int, out: memoryview) -> None:
        pos, done, n = offset % self._plen, 0, len(out)
        out_addr = ctypes.addressof(ctypes.c_char.from_buffer(out)) if not out.readonly else None
        while done < n:
            take = min(n - done, self._plen)
            if out_addr is not None:
                ctypes.memmove(out_addr + done, self._addr + pos, take)
            else:
                out[done:done + take] = self._pattern[pos:pos + take]
            done += take
            pos = (pos + take) % self._plen
