"""Filling destination buffers from checkpoint files: one copy per byte where the memory allows it.

What a load wants of a file is a list of pieces (file offset, length, destination view). They
are turned into read requests that several reader threads share, across files and within one:

* a large piece (>= SMALL bytes) is read straight into its destination with preadv(2): the part
  of it on whole 4 KiB pages of the file with O_DIRECT (open(2), "O_DIRECT": file offset and
  length aligned to the logical block size, 4 KiB covering every common device), in requests of
  at most one block so that several readers share a large tensor; its unaligned head and tail
  (under 4 KiB each) with buffered preadv into the same memory;
* where the destination's address does not have the file offset's place in its page (a tensor
  the allocator placed 64 bytes into its page, as torch.empty does), the O_DIRECT read is tried
  straight into it anyway (Linux 6.0+ checks only the device's DMA alignment of memory, 4 bytes
  on NVMe: STATX_DIOALIGN in statx(2)); where the device refuses it (EINVAL: 512-byte DMA
  alignment, virtio), each block is read with O_DIRECT into a page-aligned block of the read
  pool and copied into place ("bounce"): one memcpy, as a buffered read's copy from the page
  cache, without the page cache's allocation and reclaim;
* a request whose pages are already in the page cache (io/cache.py, mincore(2): a warm
  restart) is read buffered: memory speed, where O_DIRECT would read the device again;
* runs of small pieces are coalesced into one read of the span covering them, into a
  page-aligned block of the read pool, and memmoved out (ctypes releases the GIL);

os.preadv releases the GIL, so the threads overlap the device and each other. With check_hash,
once every request of a file is done the thread finishing it hashes the destination memory in
file order (xxh3-128 over exactly the bytes of the file: its pieces cover it end to end) and
compares with the marker. A file whose pieces do not cover it (a partial load with hashing, or
a file read only to be verified) is streamed through a block instead (`stream`).

New destination buffers are allocated so that their address has the offset in its 4 KiB page
that their bytes have in the file (sources.allocate's `residue`), which is what lets O_DIRECT
land in them whatever the sizes of the buffers saved before them.
"""
from __future__ import annotations

import ctypes
import errno
import os
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from tiered_ckpt.io import cache, fsafe
from tiered_ckpt.io.hashing import new_hasher
from tiered_ckpt.io.marker import FileEntry
from tiered_ckpt.io.pools import ALIGN, BlockPool

# Pieces below this many bytes are coalesced with their neighbours into one read and copied out;
# at and above it they are read straight into their memory (a 1 MiB memcpy costs ~50 us, a
# separate request for it more).
SMALL = 1 << 20
# Neighbouring small pieces further apart than this in the file are read separately (the gap
# would be read for nothing).
GAP = 64 << 10

# A request at least this fraction of whose pages are cached is read buffered (io/cache.py).
CACHED = 0.5

# Bytes read by each path since the process started ("direct" into the destination, "bounce"
# via a pool block, "buffered", "cached" (buffered because resident), "group" coalesced small
# pieces): what the tests and the benchmark check the paths by.
totals: dict[str, int] = dict.fromkeys(("direct", "bounce", "buffered", "cached", "group"), 0)
_totals_lock = threading.Lock()

# (file offset, nbytes, destination view) pieces of one file
Pieces = list[tuple[int, int, memoryview]]
Stream = Callable[[FileEntry, memoryview], "str | None"]


def address(view: memoryview) -> int:
    """The address of a writable, non-empty byte view."""
    return ctypes.addressof(ctypes.c_char.from_buffer(view))


@dataclass
class _File:
    entry: FileEntry
    path: Path
    pieces: Pieces
    hash: bool
    fd: int = -1
    dfd: int = -1                  # the same file opened O_DIRECT, -1 where refused or not asked
    cached: bytes | None = None    # io/cache.resident of the file, where O_DIRECT is open
    mem_direct: bool = True        # O_DIRECT into memory off the page grid not (yet) refused
    left: int = 0                  # requests not yet done
    problem: str | None = None
    lock: threading.Lock = field(default_factory=threading.Lock)


@dataclass
class _Req:
    """One read: `kind` "direct" (O_DIRECT, memory aligned), "unaligned" (O_DIRECT, memory off the
    grid: straight in or via a block), "buffered" / "cached" (straight into `dest`) or "group"
    (small pieces via a block; `cached`: buffered)."""

    f: _File
    kind: str
    off: int
    n: int
    dest: memoryview | None = None
    group: list[tuple[int, int, int]] = field(default_factory=list)   # (file offset, nbytes, address)
    cached: bool = False


def _covers(size: int, pieces: Pieces) -> bool:
    """Whether the pieces, in order, are exactly the bytes 0..size of the file."""
    pos = 0
    for off, n, _ in pieces:
        if off != pos:
            return False
        pos += n
    return pos == size


def _open(f: _File, direct: bool, anchor: Path) -> None:
    f.fd = fsafe.open_file(f.path, os.O_RDONLY, anchor=anchor)
    if not direct or not hasattr(os, "O_DIRECT"):
        return
    try:
        dfd = fsafe.open_file(f.path, os.O_RDONLY | os.O_DIRECT, anchor=anchor)
    except fsafe.UnsafePath:
        raise
    except OSError as e:
        if e.errno != errno.EINVAL:      # the file system does not do O_DIRECT (tmpfs): buffered only
            raise
        return
    a, b = os.fstat(f.fd), os.fstat(dfd)
    if (a.st_dev, a.st_ino) != (b.st_dev, b.st_ino):
        os.close(dfd)
        raise fsafe.UnsafePath(errno.ESTALE, "replaced while being opened", str(f.path))
    f.dfd = dfd
    f.cached = cache.resident(f.fd, f.entry.size)


def small_limit(block: int) -> int:
    """Pieces below this size are coalesced; a group's span (from the 4 KiB unit its first piece
    starts in) then always fits one block."""
    return min(SMALL, block - ALIGN)


def _plan(f: _File, block: int) -> list[_Req]:
    """The read requests of one file's pieces (sorted by file offset)."""
    small = small_limit(block)
    reqs: list[_Req] = []
    group: list[tuple[int, int, int]] = []
    g_start = g_end = 0

    def close_group() -> None:
        if group:
            a = g_start - g_start % ALIGN
            reqs.append(_Req(f, "group", a, g_end - a, group=list(group),
                             cached=cache.cached_fraction(f.cached, a, g_end - a) >= CACHED))
            group.clear()

    for off, n, dest in f.pieces:
        if n == 0:
            continue
        if n < small:
            if group and (off - g_end > GAP or off + n - (g_start - g_start % ALIGN) > block):
                close_group()
            if not group:
                g_start = g_end = off
            group.append((off, n, address(dest)))
            g_end = max(g_end, off + n)     # pieces may overlap (DCP may read one saved item twice)
            continue
        close_group()
        end = off + n
        a, b = -(-off // ALIGN) * ALIGN, end // ALIGN * ALIGN
        if f.dfd >= 0 and b > a:
            if a > off:
                reqs.append(_Req(f, "buffered", off, a - off, dest[:a - off]))
            kind = "direct" if (address(dest) + a - off) % ALIGN == 0 else "unaligned"
            for c in range(a, b, block):
                k = min(block, b - c)
                warm = cache.cached_fraction(f.cached, c, k) >= CACHED
                reqs.append(_Req(f, "cached" if warm else kind, c, k, dest[c - off:c - off + k]))
            if end > b:
                reqs.append(_Req(f, "buffered", b, end - b, dest[b - off:]))
        else:
            for c in range(off, end, block):
                k = min(block, end - c)
                reqs.append(_Req(f, "buffered", c, k, dest[c - off:c - off + k]))
    close_group()
    return reqs


def _pread_into(fd: int, view: memoryview, off: int, size: int, path: Path) -> None:
    """Fill `view` from file offset `off`; a file ending early is a clear error."""
    done = 0
    while done < len(view):
        n = os.preadv(fd, [view[done:]], off + done)
        if n <= 0:
            raise EOFError(f"{path}: ends at {off + done} bytes, manifest says {size}")
        done += n


def _do(r: _Req, block: memoryview, block_addr: int) -> str:
    """Carry out one request; the path its bytes took (a key of `totals`)."""
    f = r.f
    if r.kind == "direct" or (r.kind == "unaligned" and f.mem_direct):
        assert r.dest is not None
        try:
            _pread_into(f.dfd, r.dest, r.off, f.entry.size, f.path)
            return "direct"
        except OSError as e:
            if e.errno != errno.EINVAL:   # memory or device alignment refused: bounce or buffered
                raise
            if r.kind == "unaligned":
                f.mem_direct = False
    if r.kind == "unaligned":
        assert r.dest is not None
        try:
            _pread_into(f.dfd, block[:r.n], r.off, f.entry.size, f.path)
        except OSError as e:
            if e.errno != errno.EINVAL:   # a device with a larger logical block: buffered instead
                raise
        else:
            ctypes.memmove(address(r.dest), block_addr, r.n)
            return "bounce"
    if r.kind != "group":
        assert r.dest is not None
        _pread_into(f.fd, r.dest, r.off, f.entry.size, f.path)
        return "cached" if r.kind == "cached" else "buffered"
    # group: the covering span into the block, then each piece out of it
    want = min(r.n, f.entry.size - r.off)
    done = 0
    if f.dfd >= 0 and not r.cached:
        try:
            # O_DIRECT reads whole 4 KiB units; the last one may run past the end of the file.
            n = os.preadv(f.dfd, [block[:-(-r.n // ALIGN) * ALIGN]], r.off)
            done = min(n, want)
        except OSError as e:
            if e.errno != errno.EINVAL:
                raise
    if done < want:
        _pread_into(f.fd, block[done:want], r.off + done, f.entry.size, f.path)
    for off, n, addr in r.group:
        ctypes.memmove(addr, block_addr + off - r.off, n)
    return "group"


def _finish(f: _File) -> None:
    """Every request of f is done: hash its bytes in file order (their destinations) if asked."""
    if not f.hash or f.problem is not None:
        return
    h = new_hasher()
    for _, _, dest in f.pieces:
        h.update(dest)
    if h.hexdigest() != f.entry.hash:
        f.problem = f"{f.path}: content hash differs from the manifest (corrupted or changed after commit)"


def fill(ckpt_dir: Path, entries: list[FileEntry], pieces: Mapping[str, Pieces], *, pool: BlockPool, threads: int,
         direct: bool, check_hash: bool, stream: Stream, progress: Callable[[int], None] | None,
         anchor: Path | None = None) -> list[str]:
    """Read every entry (into its pieces, or through `stream`); the problems found, one per file.

    Files are opened through fsafe below `anchor` (default: `ckpt_dir`), no symlink followed.

    Each reader thread holds one block of `pool` (>= `threads` blocks); `stream(entry, view)` reads
    a file sequentially through that block (verify, or hashing a file its pieces do not cover)."""
    files: list[_File] = []
    streamed: list[FileEntry] = []
    for e in entries:
        ps = sorted(pieces.get(e.path, []), key=lambda p: p[0])
        want_hash = bool(check_hash and e.hash)
        if not ps or (want_hash and not _covers(e.size, ps)):
            streamed.append(e)
        else:
            files.append(_File(e, ckpt_dir / e.path, ps, want_hash))
    problems: list[str] = []
    per_file: list[list[_Req]] = []
    try:
        for f in files:
            try:
                _open(f, direct, anchor or ckpt_dir)
                reqs = _plan(f, pool.block_size)
            except fsafe.UnsafePath as err:
                problems.append(f"{f.path}: {err.strerror}")
                continue
            except OSError as err:
                problems.append(f"{f.path}: cannot read ({err.strerror or err})")
                continue
            f.left = len(reqs)
            per_file.append(reqs)
            if not reqs:
                _finish(f)
        # Interleave the files (one request of each in turn): every file (an OST on Lustre) stays busy.
        work: list[_Req | FileEntry] = list(streamed)
        depth = max((len(r) for r in per_file), default=0)
        work += [rs[i] for i in range(depth) for rs in per_file if i < len(rs)]
        work.reverse()                         # popped from the end
        lock = threading.Lock()

        def run() -> None:
            idx = pool.acquire()
            view, addr = pool.view(idx), pool.address(idx)
            try:
                while True:
                    with lock:
                        if not work:
                            return
                        item = work.pop()
                    if isinstance(item, FileEntry):
                        _stream_one(item, view)
                        continue
                    f = item.f
                    try:
                        if f.problem is None:
                            way = _do(item, view, addr)
                            with _totals_lock:
                                totals[way] += item.n
                    except fsafe.UnsafePath as err:
                        _fail(f, f"{f.path}: {err.strerror}")
                    except EOFError as err:
                        _fail(f, str(err))
                    except OSError as err:
                        _fail(f, f"{f.path}: cannot read ({err.strerror or err})")
                    except Exception as err:  # noqa: BLE001 - a thread that died silently would leave memory unfilled
                        _fail(f, f"{f.path}: reading failed ({type(err).__name__}: {err})")
                    if progress is not None:
                        progress(item.n if item.kind != "group" else sum(g[1] for g in item.group))
                    with f.lock:
                        f.left -= 1
                        last = f.left == 0
                    if last:
                        try:
                            _finish(f)
                        except Exception as err:  # noqa: BLE001 - as above
                            _fail(f, f"{f.path}: hashing failed ({type(err).__name__}: {err})")
            finally:
                pool.release(idx)

        def _stream_one(e: FileEntry, view: memoryview) -> None:
            try:
                msg = stream(e, view)
            except fsafe.UnsafePath as err:
                msg = f"{ckpt_dir / e.path}: {err.strerror}"
            except OSError as err:
                msg = f"{ckpt_dir / e.path}: cannot read ({err.strerror or err})"
            except Exception as err:  # noqa: BLE001 - as above
                msg = f"{ckpt_dir / e.path}: reading failed ({type(err).__name__}: {err})"
            if msg:
                with lock:
                    problems.append(msg)

        n = max(1, min(threads, len(work)))
        ts = [threading.Thread(target=run, name=f"ckpt-reader-{i}", daemon=True) for i in range(n)]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
    finally:
        for f in files:
            for fd in (f.fd, f.dfd):
                if fd >= 0:
                    os.close(fd)
    problems += [f.problem for f in files if f.problem is not None]
    return sorted(problems)


def _fail(f: _File, msg: str) -> None:
    with f.lock:
        if f.problem is None:
            f.problem = msg
