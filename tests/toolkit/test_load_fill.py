"""Load's read paths (io/fill.py): straight into the destination with O_DIRECT where the file's pages
and the memory line up, buffered where they do not or the file system refuses O_DIRECT (tmpfs),
large buffers split over several readers, small ones coalesced, hashes over the filled memory."""
from __future__ import annotations

import errno
import os
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import tiered_ckpt as tc
from tiered_ckpt.config import NodeConfig
from tiered_ckpt.errors import IntegrityError
from tiered_ckpt.io import commit, fill, fsafe, reader
from tiered_ckpt.io.marker import FileEntry
from tiered_ckpt.io.options import IoOptions

torch = pytest.importorskip("torch")

BLOCK = 256 << 10          # the test config's block: tensors above ~252 KiB are read straight into memory


def _state() -> dict[str, Any]:
    """Small sizes first, so every large tensor after them starts off the file's 4 KiB grid (and,
    after "tail", off the element grid of a float64 array: that one cannot be aligned)."""
    g = torch.Generator().manual_seed(3)
    st: dict[str, Any] = {"step": torch.tensor(7.0), "odd": torch.randint(0, 255, (4100,), dtype=torch.uint8, generator=g)}
    st["big"] = torch.randn(700, 1000, generator=g)                       # 2.8 MB: many requests, several readers
    st["half"] = torch.randn(300_001, generator=g).to(torch.float16)      # 600 KB, element size 2
    st["tail"] = torch.randint(0, 255, (1_000_003,), dtype=torch.uint8, generator=g)   # ends off the grid
    for i in range(150):                                                  # coalesced into block-sized reads
        st[f"small.{i}"] = torch.randn(1 + 37 * i, generator=g)
    st["np"] = np.arange(400_000, dtype=np.float64)                       # numpy destinations too
    return st


def _equal(a: Any, b: Any) -> bool:
    if isinstance(a, np.ndarray):
        return isinstance(b, np.ndarray) and a.dtype == b.dtype and a.shape == b.shape and bool(np.array_equal(a, b))
    return bool(a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b))


def _evict(p: Path) -> None:
    """Drop the file's pages from the page cache (written back first: dirty pages stay)."""
    fd = os.open(p, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def _kinds(monkeypatch: pytest.MonkeyPatch) -> Counter[str]:
    """Counts the planned requests of each kind (direct / buffered / group) of the next loads."""
    seen: Counter[str] = Counter()
    plan = fill._plan

    def counting(f: Any, block: int) -> list[Any]:
        reqs = plan(f, block)
        seen.update(r.kind for r in reqs)
        seen["group pieces"] += sum(len(r.group) for r in reqs)
        return reqs

    monkeypatch.setattr(fill, "_plan", counting)
    return seen


def test_new_tensors_are_filled_with_o_direct_whatever_the_offsets_and_match(cfg: NodeConfig,
                                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    st = _state()
    tc.save(st, epoch=0, step=1, config=cfg)
    kinds = _kinds(monkeypatch)
    out = tc.load(config=cfg, verify_hash=True)
    assert set(out) == set(st)
    for k, v in st.items():
        assert _equal(v, out[k]), k
    # Large buffers went straight into their memory with O_DIRECT, split over many requests
    # (several readers per tensor); the small ones in a few coalesced reads.
    assert kinds["direct"] >= 10, kinds
    assert kinds["group"] and kinds["group pieces"] >= 150 and kinds["group"] < kinds["group pieces"] / 5, kinds
    # Each new large tensor starts where its bytes start in their 4 KiB page of the file.
    d = Path(cfg.root) / "m" / "global_epoch0_step1"
    m = commit.read_marker(d)
    assert m is not None
    idx = reader.read_index(d, m, 0).buffers
    for k in ("big", "half", "tail"):
        _, file_off, _, src_off = idx[k]["segments"][0]
        assert (out[k].data_ptr() - (file_off - src_off)) % 4096 == 0, k
    # The loaded tensors are ordinary tensors: writable, and saving them again round-trips.
    out["big"].add_(1)
    assert torch.equal(out["big"], st["big"] + 1)


def test_into_buffers_at_unaligned_addresses_still_read_o_direct_and_match(cfg: NodeConfig,
                                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    st = {"pad": b"x" * 5, "w": torch.randn(600_000)}
    tc.save(st, epoch=0, step=1, config=cfg)
    for p in (Path(cfg.root) / "m" / "global_epoch0_step1").iterdir():
        _evict(p)
    # A destination 4 bytes off any page grid the file could have: O_DIRECT cannot land in it
    # on this disk (512-byte DMA alignment), so each block goes through a pool block.
    raw = torch.empty(600_000 * 4 + 4096 + 1, dtype=torch.uint8)
    off = (4096 - raw.data_ptr() % 4096) % 4096 + 4
    dest = raw[off:off + 600_000 * 4].view(torch.float32)
    assert dest.data_ptr() % 4096 == 4
    kinds = _kinds(monkeypatch)
    before = dict(fill.totals)
    out = tc.load(config=cfg, into={"w": dest}, verify_hash=True)
    assert out["w"] is dest and torch.equal(dest, st["w"])
    assert kinds["unaligned"] >= 2 and kinds["direct"] == 0, kinds
    moved = {k: fill.totals[k] - before[k] for k in fill.totals}
    assert moved["direct"] + moved["bounce"] >= 600_000 * 4 - 2 * 4096 and moved["buffered"] < 2 * 4096, moved


def test_file_system_refusing_o_direct_falls_back_to_buffered_reads(cfg: NodeConfig,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """open(2) with O_DIRECT fails with EINVAL where the file system does not support it (tmpfs
    before Linux 6.6, some FUSE mounts); this kernel's tmpfs accepts it, so the refusal is injected."""
    st = _state()
    tc.save(st, epoch=0, step=1, config=cfg)
    real = fsafe.open_file

    def refuse(path: Any, flags: int = os.O_RDONLY, *a: Any, **kw: Any) -> int:
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument", str(path))
        return real(path, flags, *a, **kw)

    monkeypatch.setattr(fsafe, "open_file", refuse)
    kinds = _kinds(monkeypatch)
    out = tc.load(config=cfg, verify_hash=True)
    assert all(_equal(v, out[k]) for k, v in st.items())
    assert kinds["direct"] == 0 and kinds["buffered"] > 0 and kinds["group"] > 0, kinds


def test_direct_off_reads_everything_buffered_and_matches(cfg: NodeConfig, monkeypatch: pytest.MonkeyPatch) -> None:
    st = _state()
    tc.save(st, epoch=0, step=1, config=cfg)
    kinds = _kinds(monkeypatch)
    out = tc.load(config=cfg, options=IoOptions(direct=False, threads=5))
    assert all(_equal(v, out[k]) for k, v in st.items())
    assert kinds["direct"] == 0 and kinds["buffered"] > 0, kinds


def _flip(path: Path, at: int) -> None:
    with open(path, "r+b") as f:
        f.seek(at)
        b = f.read(1)
        f.seek(at)
        f.write(bytes([b[0] ^ 0x01]))


@pytest.mark.parametrize("where", ["big", "small.100"])
def test_hash_check_catches_one_flipped_byte_in_memory_filled_directly_or_coalesced(cfg: NodeConfig, where: str) -> None:
    st = _state()
    tc.save(st, epoch=0, step=1, config=cfg)
    d = Path(cfg.root) / "m" / "global_epoch0_step1"
    m = commit.read_marker(d)
    assert m is not None
    path, file_off, n, _ = reader.read_index(d, m, 0).buffers[where]["segments"][0]
    _flip(d / path, file_off + n // 2)
    with pytest.raises(IntegrityError, match=f"{path}: content hash differs"):
        tc.load(config=cfg, verify_hash=True)
    # Without the hash check the load returns the flipped byte: the hash is what catches it.
    out = tc.load(config=cfg)
    assert not _equal(st[where], out[where])


def test_file_shorter_than_its_pieces_is_a_clear_error_naming_it(cfg: NodeConfig) -> None:
    st = {"w": torch.randn(300_000)}
    tc.save(st, epoch=0, step=1, config=cfg)
    d = Path(cfg.root) / "m" / "global_epoch0_step1"
    m = commit.read_marker(d)
    assert m is not None
    e = m.files[0]
    os.truncate(d / e.path, e.size - 5000)   # shrunk after load's size check (read_files checks no sizes)
    buf = bytearray(e.size)
    probs = reader.read_files(d, [e], threads=4, block_size=BLOCK, pieces={e.path: [(0, e.size, memoryview(buf))]})
    assert len(probs) == 1 and f"{d / e.path}: ends at {e.size - 5000} bytes, manifest says {e.size}" in probs[0]
    with pytest.raises(IntegrityError, match=f"{e.path}: {e.size - 5000} bytes, manifest says {e.size}"):
        tc.load("global_epoch0_step1", config=cfg)


def test_pieces_not_covering_a_file_with_hashing_stream_it_and_still_check_the_hash(cfg: NodeConfig) -> None:
    st = {"a": torch.randn(200_000), "b": torch.randn(200_000)}
    tc.save(st, epoch=0, step=1, config=cfg)
    d = Path(cfg.root) / "m" / "global_epoch0_step1"
    m = commit.read_marker(d)
    assert m is not None
    e = max(m.files, key=lambda f: f.size)
    want = memoryview(bytearray(10_000))
    pieces = {e.path: [(4096 + 3, 10_000, want)]}
    assert reader.read_files(d, [e], threads=2, block_size=BLOCK, check_hash=True, pieces=pieces) == []
    with open(d / e.path, "rb") as f:
        f.seek(4096 + 3)
        assert f.read(10_000) == bytes(want)
    _flip(d / e.path, e.size - 1)          # outside the piece: only hashing the whole file sees it
    probs = reader.read_files(d, [e], threads=2, block_size=BLOCK, check_hash=True, pieces=pieces)
    assert len(probs) == 1 and "content hash differs" in probs[0]


def test_plan_splits_large_pieces_and_keeps_head_and_tail_off_o_direct(tmp_path: Path) -> None:
    """The request plan of one file: aligned middle in block-sized O_DIRECT requests, the head and
    tail (off the 4 KiB grid) buffered, small neighbours in one group."""
    p = tmp_path / "f"
    size = 3 * BLOCK + 10_000
    p.write_bytes(os.urandom(size))
    _evict(p)                                      # cold: cached pages would be read buffered
    mem = np.empty(size + 8192, dtype=np.uint8)
    base = mem.ctypes.data
    shift = (4096 - base % 4096) % 4096 + 100      # memory residue 100 = the file offset's below
    dest = memoryview(mem[shift:shift + size - 100])
    small = [memoryview(bytearray(10)), memoryview(bytearray(90))]
    f = fill._File(FileEntry("f", size, None), p, [(0, 10, small[0]), (10, 90, small[1]), (100, size - 100, dest)],
                   hash=False)
    fill._open(f, direct=True, anchor=tmp_path)
    try:
        reqs = fill._plan(f, BLOCK)
    finally:
        os.close(f.fd)
        if f.dfd >= 0:
            os.close(f.dfd)
    assert f.dfd >= 0, "ext4 does O_DIRECT"
    kinds = [(r.kind, r.off, r.n) for r in reqs]
    assert kinds[0] == ("group", 0, 100) and len(reqs[0].group) == 2
    assert kinds[1] == ("buffered", 100, 4096 - 100)
    directs = [k for k in kinds if k[0] == "direct"]
    assert [d[1] for d in directs] == [4096 + i * BLOCK for i in range(len(directs))]
    assert all(d[2] <= BLOCK and d[1] % 4096 == 0 and d[2] % 4096 == 0 for d in directs)
    assert len(directs) == 4 and kinds[-1] == ("buffered", size // 4096 * 4096, size % 4096)
    assert sum(k[2] for k in kinds) == size


def test_overlapping_and_gapped_pieces_each_get_their_bytes(tmp_path: Path) -> None:
    """DCP may ask for one saved item twice (resharding) and skips what it does not want."""
    from tiered_ckpt.io.pools import BlockPool

    size = 5 * BLOCK + 123
    data = os.urandom(size)
    (tmp_path / "f").write_bytes(data)
    spans = [(0, 100), (10, 20), (50, 100), (200_000, 70_000), (4096 * 3, 3 * BLOCK), (4096 * 3 + 5, BLOCK),
             (size - 1000, 1000), (size - 300_000, 300_000)]
    bufs = [bytearray(n) for _, n in spans]
    pieces = {"f": [(off, n, memoryview(b)) for (off, n), b in zip(spans, bufs, strict=True)]}
    probs = fill.fill(tmp_path, [FileEntry("f", size, None)], pieces, pool=BlockPool(3 * BLOCK, BLOCK), threads=3,
                      direct=True, check_hash=False, stream=lambda e, v: "streamed", progress=None)
    assert probs == []
    for (off, n), b in zip(spans, bufs, strict=True):
        assert bytes(b) == data[off:off + n], (off, n)


def test_an_unexpected_error_in_a_reader_thread_fails_the_load_instead_of_leaving_memory_unfilled(
        cfg: NodeConfig, monkeypatch: pytest.MonkeyPatch) -> None:
    tc.save(_state(), epoch=0, step=1, config=cfg)
    real, calls = fill._do, []

    def flaky(r: Any, *a: Any) -> None:
        calls.append(r)
        if len(calls) == 3:
            raise ValueError("boom")
        real(r, *a)

    monkeypatch.setattr(fill, "_do", flaky)
    with pytest.raises(IntegrityError, match="reading failed \\(ValueError: boom\\)"):
        tc.load(config=cfg)
