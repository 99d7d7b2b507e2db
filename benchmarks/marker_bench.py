"""Marker and per-tensor benchmarks: finding the newest checkpoint, and many small tensors.

Functions (each returns a dict of figures, plain numbers and strings; nothing printed):

measure_latest(tmp: Path, n_ckpts: int = 100, n_tensors: int = 100_000) -> dict
    Builds `n_ckpts` committed checkpoints of `n_tensors` one-element tensors each under `tmp`
    (one real save; the others hard-link its files and get their own marker), then times
    `tc.latest()` (newest committed: must not parse any index) and `tc.load()`'s full scan of
    the model (`commit.scan`: every marker read and size-checked). Keys: n_ckpts, n_tensors,
    marker_bytes (one COMMITTED.json), index_bytes (its rank's index file), latest_s, scan_s,
    goal_s (1.0), met (latest_s < goal_s).

measure_many_tensors(tmp: Path, n_tensors: int = 100_000, tensor_bytes: int = 4096) -> dict
    Saves and loads `n_tensors` tensors of `tensor_bytes` each (torch float32 when torch is
    installed, else numpy) with tc.save/tc.load and with torch.save (+ fsync of its file, as
    tc.save fsyncs)/torch.load, in the same process, alternately. Keys: n_tensors,
    tensor_bytes, tc_save_s, tc_load_s, torch_save_s, torch_load_s (None without torch),
    save_ratio (tc/torch; goal <= 1), load_ratio (goal <= 1), index_bytes (the index file),
    save_rss_added_bytes (peak RSS during tc.save minus RSS before it, sampled every 5 ms),
    rss_ratio (save_rss_added_bytes / index_bytes; goal <= 2), met_save, met_load, met_rss,
    pool_rss_bytes. The sync staging pool (io.sync_buffer_bytes, allocated once per process and
    reused by every later save) is allocated by a one-byte save first and reported on its own
    (pool_rss_bytes): save_rss_added_bytes is what saving these tensors adds on top of it.

Both clean up what they write under `tmp`.
"""
from __future__ import annotations

import dataclasses
import os
import shutil
import threading
import time
from pathlib import Path
from typing import Any

import tiered_ckpt as tc
from tiered_ckpt.io import commit as mf
from tiered_ckpt.io.options import IoOptions

LATEST_GOAL_S = 1.0
_MODEL = "bench"


def _tensors(n: int, nbytes: int) -> dict[str, Any]:
    try:
        import torch
    except ImportError:
        import numpy as np

        return {f"layers.{i // 100}.p{i % 100}.weight": np.full(nbytes // 4, i, dtype=np.float32) for i in range(n)}
    return {f"layers.{i // 100}.p{i % 100}.weight": torch.full((nbytes // 4,), float(i)) for i in range(n)}


def measure_latest(tmp: Path, n_ckpts: int = 100, n_tensors: int = 100_000) -> dict[str, Any]:
    root = Path(tmp) / "marker_bench_latest"
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    try:
        tc.save(_tensors(n_tensors, 4), epoch=0, step=0, root=root, model=_MODEL, options=IoOptions(hash=True))
        first = root / _MODEL / "global_epoch0_step0"
        m = mf.read_marker(first)
        assert m is not None and m.index_files is not None
        for step in range(1, n_ckpts):
            d = root / _MODEL / f"global_epoch0_step{step}"
            d.mkdir()
            for f in m.files:
                os.link(first / f.path, d / f.path)        # same bytes, same sizes: a committed copy
            mf.write_marker(d, dataclasses.replace(m, step=step))
        os.sync()
        t = time.perf_counter()
        newest = tc.latest(root=root, model=_MODEL)
        latest_s = time.perf_counter() - t
        assert newest is not None and newest.name == f"global_epoch0_step{n_ckpts - 1}"
        t = time.perf_counter()
        infos = mf.scan(root, _MODEL)
        scan_s = time.perf_counter() - t
        assert sum(c.committed for c in infos) == n_ckpts
        return {"n_ckpts": n_ckpts, "n_tensors": n_tensors, "marker_bytes": (first / mf.MARKER).stat().st_size,
                "index_bytes": (first / m.index_files[0]).stat().st_size, "latest_s": latest_s, "scan_s": scan_s,
                "goal_s": LATEST_GOAL_S, "met": latest_s < LATEST_GOAL_S}
    finally:
        shutil.rmtree(root, ignore_errors=True)


class _PeakRss:
    """Peak resident set size while running, sampled from /proc/self/statm (Linux proc(5))."""

    def __init__(self, interval: float = 0.005) -> None:
        self.interval, self.peak = interval, 0
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)

    @staticmethod
    def now() -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, self.now())
            self._stop.wait(self.interval)

    def __enter__(self) -> _PeakRss:
        self.peak = self.now()
        self._t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._t.join()
        self.peak = max(self.peak, self.now())


def measure_many_tensors(tmp: Path, n_tensors: int = 100_000, tensor_bytes: int = 4096) -> dict[str, Any]:
    base = Path(tmp) / "marker_bench_many"
    shutil.rmtree(base, ignore_errors=True)
    base.mkdir(parents=True)
    try:
        try:
            import torch
        except ImportError:
            torch = None  # type: ignore[assignment]
        state = _tensors(n_tensors, tensor_bytes)
        torch_save_s = torch_load_s = None
        if torch is not None:
            path = base / "state.pt"
            t = time.perf_counter()
            with open(path, "wb") as f:
                torch.save(state, f)
                f.flush()
                os.fsync(f.fileno())
            torch_save_s = time.perf_counter() - t
        pool_before = _PeakRss.now()
        tc.save({"warm-up": b"0"}, epoch=0, step=0, root=base, model=_MODEL)   # allocates the pool
        before = _PeakRss.now()
        pool_rss = before - pool_before
        with _PeakRss() as rss:
            t = time.perf_counter()
            tc.save(state, epoch=0, step=1, root=base, model=_MODEL)
            tc_save_s = time.perf_counter() - t
        if torch is not None:
            t = time.perf_counter()
            loaded = torch.load(base / "state.pt")
            torch_load_s = time.perf_counter() - t
            del loaded
        t = time.perf_counter()
        got = tc.load(root=base, model=_MODEL)
        tc_load_s = time.perf_counter() - t
        assert list(got) == list(state)
        del got
        info = mf.latest_committed(base, _MODEL)
        assert info is not None and info.manifest is not None and info.manifest.index_files is not None
        index_bytes = sum((info.path / p).stat().st_size for p in info.manifest.index_files)
        added = rss.peak - before
        out: dict[str, Any] = {
            "n_tensors": n_tensors, "tensor_bytes": tensor_bytes, "tc_save_s": tc_save_s, "tc_load_s": tc_load_s,
            "torch_save_s": torch_save_s, "torch_load_s": torch_load_s, "index_bytes": index_bytes,
            "save_rss_added_bytes": added, "rss_ratio": added / index_bytes, "pool_rss_bytes": pool_rss,
            "save_ratio": tc_save_s / torch_save_s if torch_save_s else None,
            "load_ratio": tc_load_s / torch_load_s if torch_load_s else None}
        out["met_save"] = out["save_ratio"] is not None and out["save_ratio"] <= 1.0
        out["met_load"] = out["load_ratio"] is not None and out["load_ratio"] <= 1.0
        out["met_rss"] = out["rss_ratio"] <= 2.0
        return out
    finally:
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":        # python -m benchmarks.marker_bench [tmp]
    import sys

    where = Path(sys.argv[1] if len(sys.argv) > 1 else "/tmp")
    print(measure_many_tensors(where))
    print(measure_latest(where))
