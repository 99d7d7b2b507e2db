"""Async saves write from the staging area: every block of a staged state goes to disk straight
from the staged bytes (hashed there), none is copied again into the write ring; the files and
their recorded hashes match the state bit for bit. The caller's own (live) buffers are never
written from directly: a zero-copy save still copies them into the ring, where they are hashed
and written from the same bytes."""
from __future__ import annotations

import importlib.util
import time
from pathlib import Path

import numpy as np
import pytest

import tiered_ckpt as tc
from tiered_ckpt.config import NodeConfig
from tiered_ckpt.io import pipeline, pools
from tiered_ckpt.io.options import IoOptions
from tiered_ckpt.io.reader import verify

pytestmark = pytest.mark.timeout(120)
BUDGET = IoOptions(staging_bytes=64 << 20)


def _counts() -> tuple[int, int]:
    return pipeline.totals["ring"], pipeline.totals["staged"]


def _idle() -> None:
    area = pools.staging_area()
    deadline = time.monotonic() + 30
    while area.in_use and time.monotonic() < deadline:
        time.sleep(0.01)


def _state(seed: int) -> dict[str, np.ndarray]:
    rnd = np.random.default_rng(seed)
    # Sizes off the page grid: sources packed in staging as in the files, a partial last block.
    return {"w": rnd.integers(0, 1 << 30, size=(700 << 10) // 4 + 3, dtype=np.int32),
            "b": rnd.integers(0, 255, size=12345, dtype=np.uint8),
            "m": rnd.standard_normal(100_001).astype(np.float32)}


def test_an_async_save_writes_staged_bytes_without_a_ring_copy(cfg: NodeConfig, root: Path) -> None:
    _idle()
    a, b = _state(1), _state(2)
    nbytes = sum(v.nbytes for v in a.values())
    ring0, staged0 = _counts()
    h1 = tc.async_save(a, epoch=0, step=1, config=cfg, options=BUDGET)
    for v in a.values():
        v += 1                                    # the caller changes its state at once
    h2 = tc.async_save(b, epoch=0, step=2, config=cfg, options=BUDGET)   # waits for the first's staging
    h1.wait(60)
    h2.wait(60)
    ring, staged = _counts()
    assert ring - ring0 == 0, "staged bytes were copied into the write ring"
    assert staged - staged0 == nbytes + sum(v.nbytes for v in b.values())
    want = _state(1)
    for step, st in ((1, want), (2, _state(2))):
        name = f"global_epoch0_step{step}"
        assert verify(root / "m" / name, check_hash=True).ok       # marker hashes = bytes on disk
        got = tc.load(name, config=cfg, verify_hash=True)
        for k, v in st.items():
            assert got[k].dtype == v.dtype and np.array_equal(got[k], v), (step, k)


def test_a_zero_copy_save_copies_the_callers_buffers_into_the_ring(cfg: NodeConfig) -> None:
    _idle()
    st = _state(3)
    nbytes = sum(v.nbytes for v in st.values())
    ring0, staged0 = _counts()
    tc.async_save(st, epoch=0, step=3, config=cfg, zero_copy=True).wait(60)
    ring, staged = _counts()
    assert (ring - ring0, staged - staged0) == (nbytes, 0)
    got = tc.load(config=cfg, verify_hash=True)
    assert all(np.array_equal(got[k], v) for k, v in st.items())


@pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="torch not installed")
def test_dcp_async_save_through_tiered_stager_writes_staged_tensors_without_a_ring_copy(root: Path) -> None:
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

    from tiered_ckpt.dcp import TieredReader, TieredWriter
    from tiered_ckpt.dcp_stage import TieredStager

    g = torch.Generator().manual_seed(5)
    # Whole pages each (DCP's file layout packs items in size order: the blocks of an item that
    # starts on a page are one staged run); a small item shares a ring block instead.
    st = {"w": torch.randn(512, 1024, generator=g), "v": torch.randn(256, 1024, generator=g)}
    want = {k: v.clone() for k, v in st.items()}
    stager = TieredStager(budget_bytes=16 << 20)
    ring0, staged0 = _counts()
    fut = dcp.async_save(st, storage_writer=TieredWriter(str(root), "m", epoch=0, step=7), async_stager=stager,
                         async_checkpointer_type=AsyncCheckpointerType.THREAD)
    for v in st.values():
        v.add_(1)
    (fut.upload_completion if hasattr(fut, "upload_completion") else fut).result(60)
    ring, staged = _counts()
    assert ring - ring0 == 0
    assert staged - staged0 == sum(v.numel() * v.element_size() for v in want.values())
    got = {k: torch.zeros_like(v) for k, v in want.items()}
    dcp.load(got, storage_reader=TieredReader(str(root), "m", epoch=0, step=7, verify_hash=True))
    assert all(torch.equal(got[k], want[k]) for k in want)
