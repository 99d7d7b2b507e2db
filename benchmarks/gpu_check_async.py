"""GPU check of the async save paths: tc.async_save and dcp.async_save + TieredStager of CUDA state.

    python -m benchmarks.gpu_check_async            # on a node with a CUDA GPU
    python -m benchmarks.gpu_check_async --strict   # also fail when a blocked time misses its goal

One process. A transformer-like state on the GPU (the DCP check's: a few large bf16 matrices,
many mid-size, a thousand small tensors). Measured first, in this run: the device-to-host floor
(one large copy into pinned host memory, best of 3) and the host memcpy floor. Then, for each
path, two async saves in a row (the first maps and pins the staging, the second is the steady
state): the time the caller was blocked, the state changed on the GPU right after each call
returns, and a bit-exact check of what was saved (loaded back with hashes verified). Checks:
every load bit-exact, the staging pinned, and (reported; a failure with --strict) the 2nd save's
blocked time <= 1.2x the device-to-host floor. Prints one line per figure and one JSON line;
exits 1 when a check fails. Without CUDA it says "no CUDA" and exits 0.
Environment: GPU_CHECK_DIR (default .bench/gpu_async), GPU_CHECK_SIZE (default 4GiB).
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

REPO = Path(__file__).resolve().parent.parent
GOAL = 1.2          # caller-blocked time of the 2nd async save / the device-to-host floor


def _d2h_gbps(torch: Any, n: int) -> float:
    src = torch.empty(n, dtype=torch.uint8, device="cuda").fill_(1)
    dst = torch.empty(n, dtype=torch.uint8, pin_memory=True)
    best = 0.0
    for _ in range(3):
        torch.cuda.synchronize()
        t = time.perf_counter()
        dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize()
        best = max(best, n / (time.perf_counter() - t))
    return best / 1e9


def _host_gbps(torch: Any, n: int) -> float:
    a, b = torch.ones(n, dtype=torch.uint8), torch.zeros(n, dtype=torch.uint8)
    b.copy_(a)
    best = 0.0
    for _ in range(3):
        t = time.perf_counter()
        b.copy_(a)
        best = max(best, n / (time.perf_counter() - t))
    return best / 1e9


def _tc_async(torch: Any, model: dict[str, Any], root: Path, res: dict[str, Any]) -> bool:
    import tiered_ckpt as tc
    from tiered_ckpt.config import IoConfig, NodeConfig
    from tiered_ckpt.io import pools

    nbytes = sum(t.numel() * t.element_size() for t in model.values())
    cfg = NodeConfig(root=str(root), model="tc", backend="local", io=IoConfig(staging_bytes=nbytes + (1 << 30)))
    ok = True
    for k in (1, 2):
        want = {n: v.clone() for n, v in model.items()}
        torch.cuda.synchronize()
        t = time.perf_counter()
        h = tc.async_save(model, epoch=0, step=k, config=cfg)
        res[f"tc_blocked_s_{k}"] = time.perf_counter() - t
        for v in model.values():
            v.add_(1)                                 # training goes on, on the current stream
        h.wait()
        res[f"tc_total_s_{k}"] = time.perf_counter() - t
        got = tc.load(f"global_epoch0_step{k}", config=cfg, verify_hash=True)
        same = all(torch.equal(got[n], want[n].cpu()) for n in want) and list(got) == list(want)
        res[f"tc_bit_exact_{k}"] = same
        ok = ok and same
        del got, want
    res["tc_staging_pinned"] = pools.staging_area().pinned
    res["tc_staging_bytes"] = pools.staging_area().nbytes
    tc.release_staging()
    return ok and res["tc_staging_pinned"]


def _dcp_async(torch: Any, model: dict[str, Any], root: Path, res: dict[str, Any]) -> bool:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict_saver import AsyncSaveResponse

    from tiered_ckpt.dcp import TieredReader, TieredWriter
    from tiered_ckpt.dcp_stage import TieredStager

    nbytes = sum(t.numel() * t.element_size() for t in model.values())
    stager = TieredStager(budget_bytes=nbytes + (1 << 30))
    ok = True
    for k in (1, 2):
        st = {"model": model, "step": k}
        want = {n: v.clone() for n, v in model.items()}
        torch.cuda.synchronize()
        t = time.perf_counter()
        fut = dcp.async_save(st, storage_writer=TieredWriter(root, "dcp", epoch=0, step=k), async_stager=stager)
        res[f"dcp_blocked_s_{k}"] = time.perf_counter() - t
        for v in model.values():
            v.add_(1)
        upload = fut.upload_completion if isinstance(fut, AsyncSaveResponse) else fut
        upload.result()
        res[f"dcp_total_s_{k}"] = time.perf_counter() - t
        into = {n: torch.empty_like(v) for n, v in want.items()}
        got: dict[str, Any] = {"model": into, "step": 0}
        dcp.load(got, storage_reader=TieredReader(root, "dcp", epoch=0, step=k, verify_hash=True))
        same = all(torch.equal(into[n], want[n]) for n in want) and got["step"] == k
        res[f"dcp_bit_exact_{k}"] = same
        ok = ok and same
        del got, into, want
    res["dcp_staging_pinned"] = stager.pin
    stager.close()
    return ok and stager.pin


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    try:
        import torch
    except ImportError:
        print("gpu_check_async: torch is not installed; no CUDA to check")
        return 0
    if not torch.cuda.is_available():
        print("gpu_check_async: no CUDA device here (torch.cuda.is_available() is False); run it on a GPU node")
        return 0
    import torch.distributed as dist

    from benchmarks.harness import cuda_state
    from tiered_ckpt.config import parse_size

    size = parse_size(os.environ.get("GPU_CHECK_SIZE", "4GiB"), "GPU_CHECK_SIZE")
    root = Path(os.environ.get("GPU_CHECK_DIR", str(REPO / ".bench" / "gpu_async")))
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    store = tempfile.mkdtemp(prefix="gpu-async-store-")
    dist.init_process_group("gloo", init_method=f"file://{store}/s", rank=0, world_size=1)
    res: dict[str, Any] = {"device": torch.cuda.get_device_name()}
    try:
        model = cuda_state(size, torch)["model"]
        nbytes = sum(t.numel() * t.element_size() for t in model.values())
        res["bytes"] = nbytes
        res["d2h_gbps"] = _d2h_gbps(torch, min(nbytes, 1 << 30))
        res["host_memcpy_gbps"] = _host_gbps(torch, min(nbytes, 1 << 30))
        res["floor_s"] = nbytes / (res["d2h_gbps"] * 1e9)
        ok = _tc_async(torch, model, root, res)
        ok = _dcp_async(torch, model, root, res) and ok
    finally:
        dist.destroy_process_group()
        shutil.rmtree(store, ignore_errors=True)
        shutil.rmtree(root, ignore_errors=True)
    goals = {}
    for who in ("tc", "dcp"):
        ratio = res[f"{who}_blocked_s_2"] / res["floor_s"]
        res[f"{who}_ratio_2"] = ratio
        goals[who] = ratio <= GOAL
        print(f"{who}.async_save: blocked {res[f'{who}_blocked_s_1']:.3f} s (1st), {res[f'{who}_blocked_s_2']:.3f} s "
              f"(2nd) = {ratio:.2f}x the device-to-host floor {res['floor_s']:.3f} s (goal <= {GOAL}x: "
              f"{'met' if goals[who] else 'not met'}); bit-exact {res[f'{who}_bit_exact_1']}/{res[f'{who}_bit_exact_2']}, "
              f"pinned staging {res[f'{who}_staging_pinned']}")
    print(f"{nbytes / 1e9:.2f} GB of CUDA state on {res['device']}: device-to-host {res['d2h_gbps']:.1f} GB/s, host "
          f"memcpy {res['host_memcpy_gbps']:.1f} GB/s")
    res["ok"] = ok
    print(json.dumps(res))
    if not ok:
        print("gpu_check_async: FAILED (a load was not bit-exact, or the staging was not pinned)")
        return 1
    if "--strict" in args and not all(goals.values()):
        print("gpu_check_async: a blocked time missed its goal (--strict)")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
