"""GPU check of the DCP path: save/load a few GiB of CUDA state through TieredWriter/TieredReader.

    python -m benchmarks.gpu_check_dcp          # on a node with a CUDA GPU

One process, a single-rank gloo group (DCP's async_save needs a CPU backend). A transformer-like
state on the GPU (a few large bf16 matrices, many mid-size, a thousand small tensors): a
synchronous `dcp.save`, a `dcp.load` into fresh CUDA tensors (bit-exact check), then
`dcp.async_save` through TieredStager (device to pinned host copies) with the state changed
right after it returns, and a bit-exact load of what was saved. Prints GB/s (decimal) and the
time the caller was blocked, and one JSON line. Without CUDA it says so and exits 0.
Environment: GPU_CHECK_DIR (default .bench/gpu_dcp), GPU_CHECK_SIZE (default 4GiB).
"""
from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.harness import cuda_state

REPO = Path(__file__).resolve().parent.parent


def _equal(a: dict[str, Any], b: dict[str, Any], torch: Any) -> bool:
    return all(torch.equal(a[k], b[k]) for k in b)


def main(argv: list[str] | None = None) -> int:
    try:
        import torch
    except ImportError:
        print("gpu_check_dcp: torch is not installed; nothing to check")
        return 0
    if not torch.cuda.is_available():
        print("gpu_check_dcp: no CUDA device here (torch.cuda.is_available() is False); run it on a GPU node")
        return 0
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict_saver import AsyncSaveResponse

    from tiered_ckpt.config import parse_size
    from tiered_ckpt.dcp import TieredReader, TieredWriter
    from tiered_ckpt.dcp_stage import TieredStager

    size = parse_size(os.environ.get("GPU_CHECK_SIZE", "4GiB"), "GPU_CHECK_SIZE")
    root = Path(os.environ.get("GPU_CHECK_DIR", str(REPO / ".bench" / "gpu_dcp")))
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    store = tempfile.mkdtemp(prefix="gpu-dcp-store-")
    dist.init_process_group("gloo", init_method=f"file://{store}/s", rank=0, world_size=1)
    try:
        st = cuda_state(size, torch)
        nbytes = sum(t.numel() * t.element_size() for t in st["model"].values())
        gb = nbytes / 1e9
        torch.cuda.synchronize()
        res: dict[str, Any] = {"bytes": nbytes, "device": torch.cuda.get_device_name()}

        t0 = time.perf_counter()
        dcp.save(st, storage_writer=TieredWriter(root, "m", epoch=0, step=1))
        res["save_gbps"] = gb / (time.perf_counter() - t0)

        got: dict[str, Any] = {"model": {k: torch.empty_like(v) for k, v in st["model"].items()}, "step": 0}
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        dcp.load(got, storage_reader=TieredReader(root, "m", epoch=0, step=1))
        torch.cuda.synchronize()
        res["load_gbps"] = gb / (time.perf_counter() - t0)
        res["sync_bit_exact"] = _equal(got["model"], st["model"], torch) and got["step"] == 7
        del got

        want = {k: v.clone() for k, v in st["model"].items()}
        stager = TieredStager(budget_bytes=nbytes + (1 << 30))
        t0 = time.perf_counter()
        fut = dcp.async_save(st, storage_writer=TieredWriter(root, "m", epoch=0, step=2), async_stager=stager)
        res["async_blocked_s"] = time.perf_counter() - t0
        for v in st["model"].values():
            v.add_(1)                                     # training goes on
        # A stager that returns the staged state (not a Future) gets a plain Future back.
        upload = fut.upload_completion if isinstance(fut, AsyncSaveResponse) else fut
        upload.result()
        res["async_total_gbps"] = gb / (time.perf_counter() - t0)
        res["stager_pinned"] = stager.pin
        got = {"model": {k: torch.empty_like(v) for k, v in st["model"].items()}, "step": 0}
        dcp.load(got, storage_reader=TieredReader(root, "m", epoch=0, step=2, verify_hash=True))
        res["async_bit_exact"] = _equal(got["model"], want, torch)
        stager.close()
    finally:
        dist.destroy_process_group()
        shutil.rmtree(store, ignore_errors=True)
    print(f"{gb:.2f} GB of CUDA state on {res['device']}: save {res['save_gbps']:.2f} GB/s, load "
          f"{res['load_gbps']:.2f} GB/s, async_save blocked {res['async_blocked_s']:.2f} s (pinned staging: "
          f"{res['stager_pinned']}), async end to end {res['async_total_gbps']:.2f} GB/s; bit-exact: sync "
          f"{res['sync_bit_exact']}, async {res['async_bit_exact']}")
    print(json.dumps(res))
    shutil.rmtree(root, ignore_errors=True)
    return 0 if res["sync_bit_exact"] and res["async_bit_exact"] else 1


if __name__ == "__main__":
    sys.exit(main())
