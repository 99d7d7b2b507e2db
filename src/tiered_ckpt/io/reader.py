"""Reading committed checkpoints back: verify (sizes always, hashes on request) and load.

A load reads with several threads per file straight into the destination buffers (io/fill.py:
O_DIRECT where offsets and addresses line up, new buffers allocated so that they do; small
buffers coalesced into one read); verify streams each file through a page-aligned block,
hashing it inline.

Every file is opened through fsafe below the checkpoint directory: a data file that is a
symlink (to anything, inside the tree or out of it), a FIFO or a device is refused, never read.
"""
from __future__ import annotations

import errno
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tiered_ckpt.errors import IntegrityError, UserError
from tiered_ckpt.io import commit, fill, fsafe, nested
from tiered_ckpt.io.fill import Pieces
from tiered_ckpt.io.hashing import new_hasher
from tiered_ckpt.io.marker import MARKER, FileEntry, InvalidIndex, Manifest, RankIndex, check_structure, parse_index
from tiered_ckpt.io.pools import ALIGN, pool
from tiered_ckpt.io.sources import allocate, writable_view


@dataclass
class VerifyReport:
    name: str
    path: str
    committed: bool
    bytes: int = 0
    files: int = 0
    hashed: bool = False
    problems: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.committed and not self.problems


def open_read(path: Path, direct: bool, anchor: Path | None = None) -> tuple[int, bool]:
    """A read descriptor of a regular file (fsafe: no symlink below `anchor`, never blocks)."""
    if direct and hasattr(os, "O_DIRECT"):
        try:
            return fsafe.open_file(path, os.O_RDONLY | os.O_DIRECT, anchor=anchor), True
        except fsafe.UnsafePath:
            raise
        except OSError as e:
            if e.errno != errno.EINVAL:      # the file system does not do O_DIRECT (tmpfs)
                raise
    return fsafe.open_file(path, os.O_RDONLY, anchor=anchor), False


def read_files(ckpt_dir: Path, entries: list[FileEntry], *, threads: int = 8, block_size: int = 16 << 20,
               direct: bool = True, check_hash: bool = False, pieces: Mapping[str, Pieces] | None = None,
               progress: Callable[[int], None] | None = None) -> list[str]:
    """Read every file (optionally into destination pieces); the list of problems found.

    Files with pieces are read by several threads at once, straight into the pieces' memory
    (io/fill.py); a file without pieces (verify), or one to hash that its pieces do not cover,
    is streamed through a block by one thread (`_read_one`)."""
    # Sized by the configured thread count, not this checkpoint's file count: pools are cached
    # per size, so one pool serves every load instead of one pre-faulted pool per file count.
    bufs = pool("read", max(1, threads) * block_size, block_size)
    wanted = pieces or {}

    def stream(e: FileEntry, view: memoryview) -> str | None:
        return _read_one(ckpt_dir, e, view, direct, check_hash, wanted.get(e.path, []), progress)

    return fill.fill(ckpt_dir, entries, wanted, pool=bufs, threads=max(1, threads), direct=direct,
                     check_hash=check_hash, stream=stream, progress=progress)


def _spans(size: int, pieces: Pieces, whole: bool, block: int) -> list[tuple[int, int]]:
    """The byte ranges of a file to read: all of it when hashing (or nothing is wanted), else the
    pieces' ranges, merged across gaps under a block and started on a 4 KiB boundary (O_DIRECT)."""
    if whole or not pieces:
        return [(0, size)]
    out: list[tuple[int, int]] = []
    for off, n, _ in sorted(pieces, key=lambda p: p[0]):
        a = off - off % ALIGN
        if out and a <= out[-1][1] + block:
            out[-1] = (out[-1][0], max(out[-1][1], off + n))
        else:
            out.append((a, off + n))
    return out


def _read_one(ckpt_dir: Path, e: FileEntry, view: memoryview, direct: bool, check_hash: bool, pieces: Pieces,
              progress: Callable[[int], None] | None) -> str | None:
    path = ckpt_dir / e.path
    fd, _ = open_read(path, direct, anchor=ckpt_dir)
    try:
        h = new_hasher() if check_hash and e.hash else None
        pieces = sorted(pieces, key=lambda p: p[0])
        pi = 0
        for start, end in _spans(e.size, pieces, h is not None, len(view)):
            off = start
            while off < end:
                want = min(len(view), -(-(end - off) // ALIGN) * ALIGN)   # whole 4 KiB units (O_DIRECT)
                n = os.preadv(fd, [view[:want]], off)
                if n <= 0:
                    return f"{path}: ends at {off} bytes, manifest says {e.size}"
                n = min(n, e.size - off)
                chunk = view[:n]
                if h is not None:
                    h.update(chunk)
                while pi < len(pieces) and pieces[pi][0] + pieces[pi][1] <= off:
                    pi += 1
                j = pi
                while j < len(pieces) and pieces[j][0] < off + n:
                    p_off, p_n, dest = pieces[j]
                    a, b = max(p_off, off), min(p_off + p_n, off + n)
                    dest[a - p_off:b - p_off] = chunk[a - off:b - off]
                    j += 1
                off += n
                if progress is not None:
                    progress(n)
    finally:
        os.close(fd)
    if h is not None and h.hexdigest() != e.hash:
        return f"{path}: content hash differs from the manifest (corrupted or changed after commit)"
    return None


def verify(ckpt_dir: Path, *, check_hash: bool = False, threads: int = 8, block_size: int = 16 << 20,
           direct: bool = True, progress: Callable[[int], None] | None = None,
           anchor: Path | None = None) -> VerifyReport:
    """`anchor`: the checkpoint root (no symlink followed below it, the directory included)."""
    rep = VerifyReport(ckpt_dir.name, str(ckpt_dir), committed=False, hashed=check_hash)
    if not os.path.lexists(ckpt_dir):
        rep.problems.append(f"{ckpt_dir} does not exist")
        return rep
    if not fsafe.is_real_dir(ckpt_dir):
        rep.problems.append(f"{ckpt_dir} is a symbolic link or not a directory: not a checkpoint (never followed)")
        return rep
    marker = ckpt_dir / MARKER
    m, why = commit.read_marker_checked(ckpt_dir, anchor=anchor)
    if m is None:
        rep.problems.append(
            f"{marker}: not committed (invalid marker: {why})" if why is not None
            else f"no {MARKER}: not committed (a save that has not finished or crashed)"
        )
        return rep
    rep.committed = True
    rep.bytes, rep.files = m.total_bytes, len(m.files)
    rep.problems += commit.size_problems(ckpt_dir, m, anchor=anchor)
    if not rep.problems and m.index_files is not None:
        # Format 2: the ranks' indexes are outside the marker; each is checked where it is read
        # (a load), and here for every rank, so verify says whether every rank can load.
        for r in range(m.world_size):
            try:
                _indexes(ckpt_dir, m, r)
            except UserError as e:
                rep.problems.append(str(e))
    if check_hash and not rep.problems:
        unhashed = [f.path for f in m.files if not f.hash]
        if unhashed:
            rep.notes.append(f"{len(unhashed)} file(s) were saved without a hash; only their sizes were checked")
        rep.problems += read_files(ckpt_dir, m.files, threads=threads, block_size=block_size, direct=direct,
                                   check_hash=True, progress=progress)
    return rep


def _no_rank(m: Manifest, rank: int) -> UserError:
    return UserError(f"checkpoint {m.name} has no data of rank {rank} (saved by {m.world_size} rank(s)); "
                     f"pass rank= 0..{m.world_size - 1}")


def read_index(ckpt_dir: Path, m: Manifest, rank: int) -> RankIndex:
    """Rank `rank`'s index: from its index file (format 2: read below `ckpt_dir`, no symlink
    followed, checked against the marker's size and hash, then validated), or from the marker
    itself (format 1). IntegrityError "not committed (invalid index ...: why)" when the file
    is missing, damaged or invalid; never a traceback, never an index that is not the saved one."""
    if not 0 <= rank < m.world_size:
        raise _no_rank(m, rank)
    if m.index_files is None:
        ranks = m.index.get("ranks", {})
        if str(rank) not in ranks:
            raise _no_rank(m, rank)
        return RankIndex(ranks[str(rank)], m.index.get("structure", {}).get(str(rank)))
    rel = m.index_files[rank]
    entry = m.by_path[rel]                 # the marker's schema: a listed, hashed file of that rank
    path = ckpt_dir / rel

    def bad(why: str) -> IntegrityError:
        return IntegrityError(f"{ckpt_dir} is not committed (invalid index {rel}: {why}); "
                              "load another checkpoint (tiered-ckpt list shows them)")

    try:
        fd = fsafe.open_file(path, anchor=ckpt_dir)
    except FileNotFoundError:
        raise bad("missing") from None
    except fsafe.UnsafePath as e:
        raise bad(f"{e.strerror}") from None
    except OSError as e:
        raise bad(f"cannot be read ({e.strerror or e})") from None
    try:
        try:
            data = fsafe.read_fd(fd, entry.size, path)     # never more than the marker says
        except fsafe.UnsafePath:
            raise bad(f"larger than the {entry.size} bytes the marker lists") from None
        except OSError as e:
            raise bad(f"cannot be read ({e.strerror or e})") from None
    finally:
        os.close(fd)
    if len(data) != entry.size:
        raise bad(f"{len(data)} bytes, the marker lists {entry.size}")
    h = new_hasher()
    h.update(data)
    if h.hexdigest() != entry.hash:
        raise bad("content hash differs from the marker (corrupted or changed after commit)")
    try:
        return parse_index(data, m, rank)
    except InvalidIndex as e:
        raise bad(str(e)) from None


def _indexes(ckpt_dir: Path, m: Manifest, rank: int) -> tuple[RankIndex, dict[str, dict[str, Any]]]:
    """Rank `rank`'s index, and the buffers of every rank it needs (itself and the owners its
    rbuf nodes name: entries saved replicated), the structure checked against them."""
    own = read_index(ckpt_dir, m, rank)
    ranks: dict[str, dict[str, Any]] = {str(rank): own.buffers}
    if own.structure is None:
        return own, ranks
    if m.index_files is None:              # format 1: the marker's schema checked it all
        ranks.update(m.index.get("ranks", {}))
        return own, ranks
    try:
        check_structure(own, rank, None)       # its shape first: then it can be walked
        for owner in sorted({o for o, _ in nested.remote_refs(own.structure)}):
            if str(owner) not in ranks and 0 <= owner < m.world_size:
                ranks[str(owner)] = read_index(ckpt_dir, m, owner).buffers
        check_structure(own, rank, ranks)
    except InvalidIndex as e:
        raise IntegrityError(f"{ckpt_dir} is not committed (invalid index {m.index_files[rank]}: {e}); "
                             "load another checkpoint (tiered-ckpt list shows them)") from None
    return own, ranks


def load(ckpt: commit.CheckpointInfo, *, rank: int = 0, into: Mapping[Any, Any] | None = None, check_hash: bool = False,
         threads: int = 8, block_size: int = 16 << 20, direct: bool = True,
         progress: Callable[[int], None] | None = None) -> dict[Any, Any]:
    """The rank's saved state: a flat dict of buffers, or the nested state as it was saved
    (keys in the order saved).

    Entries saved as replicated (another rank wrote them: rbuf nodes) are read from that rank's files."""
    m = ckpt.manifest
    if m is None:
        why = ckpt.why_not_committed or f"not committed (no valid {MARKER})"
        raise IntegrityError(f"{ckpt.path} is {why}; load a committed checkpoint (tiered-ckpt list)")
    own, ranks = _indexes(ckpt.path, m, rank)
    idx, tree = own.buffers, own.structure
    if tree is None:
        unknown = sorted(set(into or {}) - set(idx))
        if unknown:
            raise UserError(f"load into: {unknown} not in checkpoint {m.name} (it holds {sorted(idx)[:10]})")
        flat: dict[nested.BufferKey, Any] = {k: v for k, v in idx.items()}
        return _load_entries(ckpt, m, flat, rank, into or {}, check_hash, threads, block_size, direct, progress)
    dests = nested.destinations(tree, into, f"checkpoint {m.name}") if into else {}
    entries: dict[nested.BufferKey, Any] = {k: v for k, v in idx.items()}
    for owner, name in nested.remote_refs(tree):    # checked above: they exist
        entries[(owner, name)] = ranks[str(owner)][name]
    buffers = _load_entries(ckpt, m, entries, rank, dests, check_hash, threads, block_size, direct, progress)
    out = nested.unflatten(tree, buffers)
    assert isinstance(out, dict)    # the top of a saved state is a mapping (api refuses anything else)
    return out


def _load_entries(ckpt: commit.CheckpointInfo, m: Manifest, entries: Mapping[nested.BufferKey, Any], rank: int,
                  into: Mapping[nested.BufferKey, Any], check_hash: bool, threads: int, block_size: int, direct: bool,
                  progress: Callable[[int], None] | None) -> dict[nested.BufferKey, Any]:
    out: dict[nested.BufferKey, Any] = {}
    pieces: dict[str, Pieces] = {}
    for key, entry in entries.items():
        name = key if isinstance(key, str) else key[1]
        if key in into:
            view = writable_view(name, into[key])
            if view.nbytes != entry["nbytes"]:
                raise IntegrityError(f"load into {name!r}: buffer has {view.nbytes} bytes, checkpoint {m.name} holds {entry['nbytes']}")
            out[key] = into[key]
        else:
            out[key], view = _allocate(m.name, name, entry, _residue(entry, block_size))
        for path, file_off, n, src_off in entry["segments"]:
            pieces.setdefault(path, []).append((file_off, n, view[src_off:src_off + n]))
    problems = commit.size_problems(ckpt.path, m, anchor=ckpt.path)
    if problems:
        raise IntegrityError(f"checkpoint {m.name} is damaged: " + "; ".join(problems))
    files = [f for f in m.files if f.path in pieces or (check_hash and f.rank == rank)]
    problems = read_files(ckpt.path, files, threads=threads, block_size=block_size, direct=direct,
                          check_hash=check_hash, pieces=pieces, progress=progress)
    if problems:
        raise IntegrityError(f"checkpoint {m.name} failed verification: " + "; ".join(problems))
    return out


def _residue(entry: Mapping[str, Any], block_size: int) -> int | None:
    """Where in its 4 KiB page a new buffer should start so that its bytes line up with the file's
    pages (O_DIRECT straight into it); None for buffers small enough to be copied out of a block."""
    segs = entry.get("segments") or []
    if entry["nbytes"] < fill.small_limit(block_size) or not segs:
        return None
    _, file_off, _, src_off = segs[0]
    return int(file_off - src_off) % ALIGN


def _allocate(ckpt: str, name: str, entry: Mapping[str, Any], residue: int | None = None) -> tuple[Any, memoryview]:
    """A new buffer for a saved one; a kind/dtype/shape the marker got wrong is an IntegrityError.

    The marker's schema bounds the shape by nbytes, but only the array library knows whether a
    dtype name is one of its own (a marker naming `torch.load` as a dtype must not crash load).
    """
    try:
        obj, view = allocate(entry, residue)
    except (TypeError, ValueError, AttributeError, RuntimeError, MemoryError) as e:
        raise IntegrityError(f"checkpoint {ckpt}: buffer {name!r} cannot be allocated as recorded in its marker "
                             f"(kind {entry.get('kind')!r}, dtype {entry.get('dtype')!r}, shape {entry.get('shape')!r}: "
                             f"{str(e).splitlines()[0][:200] if str(e) else type(e).__name__}); the marker is invalid") from None
    if view.nbytes != entry["nbytes"]:
        raise IntegrityError(f"checkpoint {ckpt}: buffer {name!r} is {entry['nbytes']} bytes in its marker, but its "
                             f"dtype {entry.get('dtype')!r} and shape {entry.get('shape')!r} make {view.nbytes}; the marker is invalid")
    return obj, view
