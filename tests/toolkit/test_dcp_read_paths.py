"""TieredReader's read paths (io/fill.py) for the tensors DCP hands it: O_DIRECT into destinations
wherever the allocator placed them (a torch.empty tensor starts 64 bytes into its page), only the
rows a resharded rank asks for, the page cache for files already resident; bit-exact every time.
Which path the bytes took is read from fill.totals (bytes per path), never from timings."""
from __future__ import annotations

import fcntl
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tiered_ckpt.config import IoConfig, NodeConfig
from tiered_ckpt.io import fill

torch = pytest.importorskip("torch")
dcp = pytest.importorskip("torch.distributed.checkpoint")

from tiered_ckpt.dcp import TieredReader, TieredWriter  # noqa: E402

BLOCK = 256 << 10


def _cfg(root: Path) -> NodeConfig:
    return NodeConfig(root=str(root), model="m", backend="local",
                      io=IoConfig(threads=3, files_per_rank=2, block_size=BLOCK, sync_buffer_bytes=1 << 20))


def _state() -> dict[str, Any]:
    """Odd sizes, so that the large tensors start at odd offsets of their files."""
    g = torch.Generator().manual_seed(5)
    return {"step": torch.tensor(3.0), "odd": torch.randint(0, 255, (4099,), dtype=torch.uint8, generator=g),
            "w": torch.randn(700, 513, generator=g), "h": torch.randn(300_007, generator=g).to(torch.bfloat16),
            "m": torch.randn(1000, 301, generator=g).double()}


def _evict(d: Path) -> None:
    for p in d.iterdir():
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def _warm(d: Path) -> None:
    for p in d.iterdir():
        p.read_bytes()


def _off_page(like: Any, residue: int) -> Any:
    """An uninitialised tensor like `like` whose first byte is `residue` bytes into its page."""
    n = like.numel() * like.element_size()
    raw = torch.empty(n + 8192, dtype=torch.uint8)
    start = (residue - raw.data_ptr()) % 4096
    t = raw[start:start + n].view(like.dtype).view(like.shape)
    assert t.data_ptr() % 4096 == residue
    return t.fill_(7) if t.is_floating_point() else t.zero_()


def _delta(before: dict[str, int]) -> dict[str, int]:
    return {k: fill.totals[k] - before[k] for k in fill.totals}


@pytest.mark.parametrize("residue", [64, 8, 2048])
def test_dcp_load_into_tensors_off_their_page_reads_o_direct_and_is_bit_exact(tmp_path: Path, residue: int) -> None:
    cfg = _cfg(tmp_path)
    want = _state()
    dcp.save(want, storage_writer=TieredWriter(config=cfg, epoch=0, step=1))
    ckpt = tmp_path / "m" / "global_epoch0_step1"
    _evict(ckpt)
    got = {k: _off_page(v, residue) for k, v in want.items()}
    ptrs = {k: v.data_ptr() for k, v in got.items()}
    before = dict(fill.totals)
    dcp.load(got, storage_reader=TieredReader(config=cfg, epoch=0, step=1))
    moved = _delta(before)
    for k, v in want.items():
        assert got[k].dtype == v.dtype and torch.equal(got[k], v), k
        assert got[k].data_ptr() == ptrs[k], f"{k}: loaded into a new tensor, not DCP's destination"
    large = sum(v.numel() * v.element_size() for k, v in want.items() if k in ("w", "h", "m"))
    # Every large tensor's bytes on whole pages of the file went O_DIRECT (straight in or via
    # a pool block); only heads and tails under a page each were read buffered.
    assert moved["direct"] + moved["bounce"] >= large - 3 * 2 * 4096, moved
    assert moved["buffered"] < 3 * 2 * 4096 and moved["cached"] == 0, moved


def test_o_direct_into_memory_off_the_page_grid_is_tried_straight_in_then_bounced(tmp_path: Path,
                                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """Where the device accepts memory off the page grid (its DMA alignment: 4 bytes on NVMe, 512
    on this virtio disk) the bytes go straight in; where it refuses (EINVAL) each block is bounced.
    Destinations 1536 bytes into their page take both paths: straight in here, and bounced where
    a refusal like a 4 KiB-aligned device's is injected."""
    cfg = _cfg(tmp_path)
    want = _state()
    dcp.save(want, storage_writer=TieredWriter(config=cfg, epoch=0, step=1))
    ckpt = tmp_path / "m" / "global_epoch0_step1"
    real = os.preadv
    for refuse in (False, True):
        _evict(ckpt)

        def preadv(fd: int, bufs: list[memoryview], off: int, *a: Any, refuse: bool = refuse) -> int:
            if refuse and fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT and fill.address(bufs[0]) % 4096:
                raise OSError(22, "Invalid argument")
            return real(fd, bufs, off, *a)

        monkeypatch.setattr(os, "preadv", preadv)
        got = {k: _off_page(v, 1536) for k, v in want.items()}
        before = dict(fill.totals)
        dcp.load(got, storage_reader=TieredReader(config=cfg, epoch=0, step=1))
        moved = _delta(before)
        assert all(torch.equal(got[k], v) for k, v in want.items())
        if refuse:
            assert moved["bounce"] > 0 and moved["direct"] == 0, moved
        else:                        # those whose memory at the first whole file page is 512-aligned
            assert moved["direct"] > 0, moved


def test_files_in_the_page_cache_are_read_buffered_and_cold_ones_o_direct(tmp_path: Path) -> None:
    """The per-request choice (io/cache.py, mincore): resident pages from the page cache (a warm
    restart), evicted ones (posix_fadvise DONTNEED) from the device."""
    cfg = _cfg(tmp_path)
    want = _state()
    dcp.save(want, storage_writer=TieredWriter(config=cfg, epoch=0, step=1))
    ckpt = tmp_path / "m" / "global_epoch0_step1"
    large = sum(v.numel() * v.element_size() for k, v in want.items() if k in ("w", "h", "m"))
    for resident in (True, False, True):
        (_warm if resident else _evict)(ckpt)
        got = {k: torch.empty_like(v) for k, v in want.items()}
        before = dict(fill.totals)
        dcp.load(got, storage_reader=TieredReader(config=cfg, epoch=0, step=1))
        moved = _delta(before)
        assert all(torch.equal(got[k], v) for k, v in want.items())
        if resident:
            assert moved["cached"] >= large - 3 * 2 * 4096 and moved["direct"] + moved["bounce"] == 0, moved
        else:
            assert moved["direct"] + moved["bounce"] >= large - 3 * 2 * 4096 and moved["cached"] == 0, moved


RESHARD = r"""
import json, os, sys
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor
from tiered_ckpt.config import IoConfig, NodeConfig
from tiered_ckpt.dcp import TieredReader
from tiered_ckpt.io import fill
root, store, rank, world = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
mesh = init_device_mesh("cpu", (world,))
cfg = NodeConfig(root=root, model="m", backend="local", io=IoConfig(threads=3, block_size=256 << 10))
g = torch.Generator().manual_seed(5)
full = torch.randn(1000, 777, generator=g)
out = {}
for dim in (0, 1):
    st = {f"w{dim}": distribute_tensor(torch.zeros_like(full), mesh, [Shard(dim)])}
    before = dict(fill.totals)
    dcp.load(st, storage_reader=TieredReader(config=cfg, epoch=0, step=1))
    local = st[f"w{dim}"].to_local()
    out[dim] = {"ok": bool(torch.equal(local, torch.chunk(full, world, dim=dim)[rank])),
                "read": {k: fill.totals[k] - before[k] for k in fill.totals}, "local": local.numel() * 4}
print(json.dumps(out), flush=True)
dist.barrier()
os._exit(0)
"""


def test_resharded_load_reads_only_each_ranks_rows_o_direct_into_its_shard(tmp_path: Path) -> None:
    """Saved whole by one process, loaded by two gloo ranks as row shards (dim 0: each rank's
    part is one byte range, read straight into its local tensor, nothing else read) and as column
    shards (dim 1: not one range; the whole item is read and the columns copied)."""
    cfg = _cfg(tmp_path)
    g = torch.Generator().manual_seed(5)
    full = torch.randn(1000, 777, generator=g)
    dcp.save({"w0": full, "w1": full.clone()}, storage_writer=TieredWriter(config=cfg, epoch=0, step=1))
    _evict(tmp_path / "m" / "global_epoch0_step1")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    ps = [subprocess.Popen([sys.executable, "-c", RESHARD, str(tmp_path), str(tmp_path / "store"), str(r), "2"],
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env) for r in range(2)]
    outs = []
    for p in ps:
        out, err = p.communicate(timeout=120)
        assert p.returncode == 0, err[-3000:]
        outs.append(json.loads(out.strip().splitlines()[-1]))
    whole = 1000 * 777 * 4
    for o in outs:
        rows, cols = o["0"], o["1"]
        assert rows["ok"] and cols["ok"], o
        assert sum(rows["read"].values()) == rows["local"], o          # its rows only, not the whole item
        assert rows["read"]["direct"] + rows["read"]["bounce"] >= rows["local"] - 2 * 4096, o
        assert sum(cols["read"].values()) == whole, o
