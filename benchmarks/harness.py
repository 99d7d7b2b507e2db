"""What every benchmark suite shares: the disk's figure (fio), cache dropping, the machine's facts,
deterministic states, statistics and the results report. Suites import this module and never
each other (the import contracts in pyproject.toml keep it so)."""
from __future__ import annotations

import json
import os
import platform
import resource
import shutil
import statistics
import subprocess
import sys
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent

# What a suite's main() returns: 0 every goal met; GOALS_MISSED some goal not met on this machine
# (reported in its table, not a failure); BENCH_ERROR the suite could not measure (missing fio, a
# child that failed), which makes `python -m benchmarks` exit nonzero.
GOALS_MISSED = 1
BENCH_ERROR = 2

# Every writer's and reader's goal against the disk's own figure (`disk`).
DISK_GOAL = 0.95
# The disk's figure: fio's best over these queue depths and job counts (issue: one synchronous
# request per writer thread is not what the device can do; a ratio above 1 against a weak fio run
# means nothing).
FIO_DEPTHS, FIO_JOBS = (1, 8), (4, 8)
FIO_BLOCK = 16 << 20
FIO_MAX_BYTES = 2 << 30          # per fio run: enough for a steady figure, bounded bench time


def tools_missing(torch_for: str) -> bool:
    """Say on stderr what is missing (fio, torch) and how to install it; True when something is."""
    if shutil.which("fio") is None:
        print("fio not found: run `make install` (installs Debian's fio)", file=sys.stderr)
        return True
    try:
        import torch  # noqa: F401
    except ImportError:
        print(f"torch not installed: {torch_for} (`make install` installs the pinned CPU torch)", file=sys.stderr)
        return True
    return False


def report(res: dict[str, Any], out: Path, as_json: bool, render: Callable[[dict[str, Any]], str]) -> int:
    """Write the results to `out`, print the JSON or the table; 0 when every goal is met, else GOALS_MISSED."""
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=2) + "\n")
    if as_json:
        print(json.dumps(res))
    else:
        print(render(res))
        print(f"results: {out}")
    return 0 if all(res["met"].values()) else GOALS_MISSED     # in the table; not an error of the bench


# -- the disk ------------------------------------------------------------------------------------
def fio(directory: Path, rw: str, size: int, jobs: int, block: int, depth: int = 1) -> float:
    """fio GB/s (decimal) for one sequential O_DIRECT write (fsync at the end) or read of `size`
    bytes over `jobs` files at queue depth `depth`."""
    directory.mkdir(parents=True, exist_ok=True)
    cmd = ["fio", "--name=ckpt", f"--directory={directory}", f"--rw={rw}", f"--bs={block}", f"--size={size // jobs}",
           f"--numjobs={jobs}", "--direct=1", "--ioengine=libaio", f"--iodepth={depth}", "--group_reporting",
           "--output-format=json"]
    if rw == "write":
        cmd += ["--end_fsync=1", "--fallocate=none"]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    job = json.loads(out[out.index("{"):])["jobs"][0]
    return float(job[rw]["bw_bytes"]) / 1e9


def disk(directory: Path, size: int, block: int = FIO_BLOCK) -> dict[str, Any]:
    """The disk's write and read figures: fio's best over FIO_DEPTHS x FIO_JOBS (each run its own
    files; written first, then read with caches dropped). {"write", "read", "runs": {"write qd1 x4": ...}}."""
    # A tiny state (--quick, the smoke tests) gets smaller blocks instead of 128 MiB of fio per run.
    block = max(1 << 20, min(block, size // (8 * max(FIO_JOBS)) // (1 << 20) << 20))
    size = max(block * max(FIO_JOBS), min(size, FIO_MAX_BYTES))
    runs: dict[str, float] = {}
    for jobs in FIO_JOBS:
        n = max(jobs * block, size // (jobs * block) * jobs * block)     # whole blocks per job
        for depth in FIO_DEPTHS:
            d = directory / f"j{jobs}-d{depth}"
            shutil.rmtree(d, ignore_errors=True)
            runs[f"write qd{depth} x{jobs}"] = fio(d, "write", n, jobs, block, depth)
            drop_caches()
            runs[f"read qd{depth} x{jobs}"] = fio(d, "read", n, jobs, block, depth)
            shutil.rmtree(d, ignore_errors=True)
    best = {rw: max(v for k, v in runs.items() if k.startswith(rw)) for rw in ("write", "read")}
    return {**best, "runs": runs,
            "best_of": {rw: max((k for k in runs if k.startswith(rw)), key=runs.__getitem__) for rw in ("write", "read")}}


def drop_caches() -> bool:
    """sync, then drop the page cache and the dentry/inode caches (proc(5); needs root)."""
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


# -- the machine and the process ------------------------------------------------------------------
def machine() -> dict[str, Any]:
    """Facts printed beside every figure: cores this process may use, load average, kernel, memory."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") if hasattr(os, "sysconf") else 0
    return {"cores": cores, "load_average": [round(x, 2) for x in os.getloadavg()], "kernel": platform.release(),
            "memory_gib": round(mem / (1 << 30), 1), "python": platform.python_version()}


def cpu_seconds() -> float:
    """User + system CPU seconds of this process so far (getrusage(2), all threads)."""
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def own_share(profile: Any, package: Path) -> float:
    """The fraction of a cProfile run's time spent in `package`'s code: its functions' own time plus
    the builtins' (C calls: torch ops, memmove) time where they were called from it. DCP's and
    torch's Python code called by DCP is not ours, nor (un)pickling DCP's Metadata object: every
    storage pays that (FileSystemWriter/Reader too); its size is a goal of its own."""
    import pstats

    st = pstats.Stats(profile)
    pkg = str(package)
    ours = 0.0
    for (file, _, name), (_, _, tt, _, callers) in st.stats.items():  # type: ignore[attr-defined]
        if file.startswith(pkg):
            ours += tt
        elif file == "~" and "_pickle" not in name:
            ours += sum(v[2] for (cf, _, _), v in callers.items() if cf.startswith(pkg))
    total = st.total_tt  # type: ignore[attr-defined]
    return ours / total if total else 0.0


# -- statistics ------------------------------------------------------------------------------------
def rotate(items: list[Any], r: int) -> list[Any]:
    """`items` started at round r's one: who goes first changes every round."""
    k = r % len(items)
    return items[k:] + items[:k]


def stats(xs: list[float]) -> dict[str, float]:
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs)}


def parse_size(text: str, what: str) -> int:
    from tiered_ckpt.config import parse_size as parse

    return parse(text, what)


def env_size(name: str, default: str) -> int:
    return parse_size(os.environ.get(name, default), name)


# -- deterministic states ---------------------------------------------------------------------------
MANY_BYTES = 4096                # the issue's many-tensor state: 4 KiB each
_POOL: dict[str, Any] = {}


def fill_tensor(t: Any, seed: int) -> None:
    """Deterministic, incompressible-looking contents at memory-copy speed: slices of one random pool."""
    import torch

    pool = _POOL.get("p")
    if pool is None:
        g = torch.Generator().manual_seed(0)
        pool = _POOL["p"] = torch.rand(4 << 20, generator=g)      # 16 MiB
    flat = t.view(-1)
    n, start = flat.numel(), (seed * 7919) % pool.numel()
    done = 0
    while done < n:
        k = min(n - done, pool.numel() - start)
        flat[done:done + k].copy_(pool[start:start + k])
        done += k
        start = 0


def seed_of(key: str) -> int:
    return zlib.crc32(key.encode())


def build_many(count: int, fill: bool = True) -> dict[str, Any]:
    """`count` separate tensors of 4 KiB (each its own storage, as parameters are)."""
    import torch

    n = MANY_BYTES // 4
    model = {}
    for i in range(count):
        name = f"blocks.{i // 64}.p{i % 64}"
        t = model[name] = torch.empty(n)
        if fill:
            fill_tensor(t, seed_of(name))
    return {"model": model}


def expected(key: str, like: Any) -> Any:
    """What a state built with `fill_tensor(t, seed_of(key))` holds under `key`."""
    import torch

    t = torch.empty_like(like)
    fill_tensor(t, seed_of(key))
    return t


def tensor_bytes(obj: Any) -> tuple[int, int]:
    """(bytes, tensors) in a nested state dict."""
    import torch

    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size(), 1
    items = obj.values() if isinstance(obj, dict) else obj if isinstance(obj, (list, tuple)) else ()
    total = count = 0
    for v in items:
        b, c = tensor_bytes(v)
        total, count = total + b, count + c
    return total, count


def cuda_state(total: int, torch: Any) -> dict[str, Any]:
    """About `total` bytes of bf16/fp32 CUDA tensors, transformer-like sizes, seeded (the GPU checks)."""
    g = torch.Generator(device="cuda").manual_seed(0)
    state: dict[str, Any] = {}
    big = total // 2 // 4                                # four large matrices: half the bytes
    for i in range(4):
        state[f"embed{i}"] = torch.randn(big // 2 // 4096, 4096, generator=g, device="cuda").to(torch.bfloat16)
    mid, left = 32 << 20, total - sum(t.numel() * t.element_size() for t in state.values())
    for i in range(max(1, (left - (64 << 20)) // mid)):
        state[f"layer{i}.w"] = torch.randn(mid // 4 // 1024, 1024, generator=g, device="cuda")
    for i in range(1000):
        state[f"norm{i}"] = torch.randn(4096, generator=g, device="cuda")
    return {"model": state, "step": 7}
