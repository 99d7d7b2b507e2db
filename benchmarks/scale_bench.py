"""Speed at scale: every goal of the save/load path, each measured, with its threshold and met / NOT MET.

Side by side in one run, on the same directory, fsync included, each figure timed from the call to
its return in a fresh process after `sync` and dropping the page cache (as root; else
posix_fadvise(DONTNEED) on the bench's files), in N interleaved rounds whose order rotates; ratios are
taken within a round, then medians and (min-max) ranges.

  1. a transformer-like state (a few 256 MiB matrices, ~100 of 16-24 MiB, ~1,000 of 4-64 KiB,
     with its AdamW exp_avg/exp_avg_sq moments; ~4 GiB at --scale 1): tc.save vs fio's sequential
     write of the same bytes, tc.load into new tensors (scanning the markers) vs fio's read;
     torch.save (+ fsync) and torch.load beside them for context; tc.save of the same state at a
     quarter the size (~1 GiB) vs the same fio figure (fixed per-save costs);
  2. 100,000 tensors of 4 KiB: tc.save vs torch.save + fsync, tc.load vs torch.load; the RSS the
     save adds (peak, /proc/self/status VmHWM after resetting it) against the checkpoint's index size;
  3. the commit marker's size (COMMITTED.json) for both; tc.latest() among 100 kept checkpoints of
     100,000 tensors each (one real save, replicated with hard links and a marker naming each step);
  4. async_save: caller-blocked time of the 2nd save against the memory-copy floor (state bytes /
     host memcpy GB/s measured in the same process), a CPU-bound training loop's throughput while
     the background write runs, and the first async_save of a 4 KiB tensor (time, RSS added);
  5. key order: the loaded state's keys, at every level, in the order saved.

    python -m benchmarks scale [--scale 1.0] [--rounds 2] [--many 100000] [--kept 100] [--json] [--quick]
    env: BENCH_SCALE, BENCH_SCALE_ROUNDS, BENCH_SCALE_MANY, BENCH_SCALE_DIR (default .bench/scale)

A missed goal is reported in the table (and `--json`), not turned into a failed `make bench`: main()
returns benchmarks.GOALS_MISSED for it, and benchmarks.BENCH_ERROR only when the bench could not run.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from benchmarks.harness import (
    BENCH_ERROR,
    DISK_GOAL,
    build_many,
    cpu_seconds,
    disk,
    drop_caches,
    expected,
    fill_tensor,
    report,
    rotate,
    seed_of,
    stats,
    tensor_bytes,
    tools_missing,
)
from tiered_ckpt.config import IoConfig

REPO = Path(__file__).resolve().parent.parent
MODEL = "bench"
MARKER = "COMMITTED.json"           # the commit marker's file name (the toolkit's io.marker.MARKER)
# (comparison, threshold) per goal of the issue; "ratio" rows are ours / the peer's, within a round.
GOALS: dict[str, tuple[str, float]] = {
    "write_vs_fio": (">=", DISK_GOAL),     # tc.save GB/s / the disk's write figure (harness.disk: fio's best)
    "write_1g_vs_fio": (">=", DISK_GOAL),  # the same for a state a quarter the size (1 GiB at scale 1): fixed costs
    "load_vs_fio": (">=", DISK_GOAL),          # tc.load into new tensors GB/s / fio read GB/s
    "many_save_vs_torch": ("<=", 1.0),     # tc.save seconds / torch.save (+ fsync) seconds, 100k x 4 KiB
    "many_load_vs_torch": ("<=", 1.0),     # tc.load seconds / torch.load seconds
    "many_rss_vs_index": ("<=", 2.0),      # RSS added while saving / the index's bytes
    "marker_state_bytes": ("<=", 64 << 10),  # COMMITTED.json: files, sizes, hashes, save id; no per-tensor index
    "marker_many_bytes": ("<=", 64 << 10),
    "latest_s": ("<", 1.0),                # tc.latest() among --kept checkpoints of --many tensors
    "async_block_vs_floor": ("<=", 1.2),   # 2nd async_save's blocked time / (state bytes / memcpy GB/s)
    "train_throughput": (">=", 0.90),      # loop iterations/s during the background write / without it
    "bg_cpu_s_per_GB": ("<=", 0.3),        # CPU seconds (user + system) of the background write per GB
    "small_async_rss": ("<=", 64 << 20),   # RSS added by the first async_save of a 4 KiB tensor
    "key_order": ("==", 1.0),              # 1 when every loaded state's keys come back in the order saved
}
GIB = 1 << 30
ISSUE_STATE, ISSUE_MANY, ISSUE_KEPT = 4 * GIB, 100_000, 100
# The issue's fixture at scale 1 (the largest process holds the state and its staging copy: ~8 GiB);
# 2 rounds keep the suite near 7 minutes on the 2-core machine (the 100,000-tensor saves and loads
# do not shrink with --scale).
DEFAULT_SCALE, DEFAULT_ROUNDS = 1.0, 2
DEFAULT_SMALL = 1000
SMALL_STATE = 0.25                         # the smaller state's size as a fraction of --scale's (1 GiB at 1.0)
LATEST_TIMEOUT = 30.0                      # a latest() this slow has missed a < 1 s goal by far; later rounds skip it
HIDDEN = 2048                              # layer width at scale 1: 16 and 24 MiB fp32 matrices
STEP = 1000.0                              # every parameter's AdamW step counter


# -- fixtures (built the same way, deterministically, in every fresh process) -------------------
def layout(scale: float, small: int) -> list[tuple[str, tuple[int, ...]]]:
    """Parameter names and fp32 shapes; with AdamW's two moments the state is ~4 GiB x scale.

    Two embedding-like matrices of 256 MiB x scale, layers of seven matrices (four d x d, three
    1.5d x d: 16 and 24 MiB at d=2048) for the rest of the parameters' third, and `small` tensors of
    4-64 KiB (norms, biases, adapters) spread over the layers.
    """
    params = int(ISSUE_STATE * scale) // 3
    big = params * 3 // 8 // 2                           # two matrices: 3/8 of the parameters
    d = HIDDEN
    while d > 64 and 34 * d * d > (params - 2 * big):    # at least one layer at small scales
        d //= 2
    layer_bytes = (4 * d * d + 3 * (3 * d // 2) * d) * 4
    n_layers = max(1, round((params - 2 * big) / layer_bytes))
    rows = max(1, big // (d * 4))
    names: list[tuple[str, tuple[int, ...]]] = [("tok_embeddings.weight", (rows, d))]
    for i in range(n_layers):
        p = f"layers.{i}."
        names += [(p + f"attention.{w}.weight", (d, d)) for w in ("wq", "wk", "wv", "wo")]
        names += [(p + "feed_forward.w1.weight", (3 * d // 2, d)), (p + "feed_forward.w2.weight", (d, 3 * d // 2)),
                  (p + "feed_forward.w3.weight", (3 * d // 2, d))]
    sizes = (1024, 2048, 4096, 8192, 16384)              # fp32 elements: 4, 8, 16, 32, 64 KiB
    names += [(f"layers.{j % n_layers}.adapters.{j // n_layers}.weight", (sizes[j % len(sizes)],)) for j in range(small)]
    names += [("norm.weight", (d,)), ("output.weight", (rows, d))]
    return names


def build_state(scale: float, small: int, fill: bool = True) -> dict[str, Any]:
    """{"model": module.state_dict(), "optim": AdamW.state_dict()}, as a training loop saves them.

    The optimizer's per-parameter state is set directly rather than by a step (which would
    allocate gradients); names, structure and param_groups are torch's own. Contents depend only
    on each tensor's name, so a load can be checked without a second state.
    """
    import torch
    from torch import nn

    model = nn.Module()
    for name, shape in layout(scale, small):
        parent = model
        *path, leaf = name.split(".")
        for part in path:
            child = getattr(parent, part, None)
            if child is None:
                child = nn.Module()
                parent.add_module(part, child)
            parent = child
        p = nn.Parameter(torch.empty(shape))
        if fill:
            with torch.no_grad():
                fill_tensor(p, seed_of(name))
        parent.register_parameter(leaf, p)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    for name, p in model.named_parameters():
        m, v = torch.empty(p.shape), torch.empty(p.shape)
        if fill:
            fill_tensor(m, seed_of(name + ".exp_avg"))
            fill_tensor(v, seed_of(name + ".exp_avg_sq"))
        opt.state[p] = {"step": torch.tensor(STEP), "exp_avg": m, "exp_avg_sq": v}
    return {"model": model.state_dict(), "optim": opt.state_dict()}


def key_paths(obj: Any, prefix: str = "") -> Iterator[str]:
    """Every key of a nested state, depth first, in the container's own order."""
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield f"{prefix}/{k!r}"
            yield from key_paths(v, f"{prefix}/{k!r}")
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            yield from key_paths(v, f"{prefix}[{i}]")


def check_loaded(what: str, got: dict[str, Any]) -> bool:
    """Spot check of contents after a load (not timed): tensors from the start, middle and end, steps."""
    import torch

    model = got["model"] if what == "state" else got
    keys = list(model)
    for k in {keys[0], keys[len(keys) // 3], keys[2 * len(keys) // 3], keys[-1]}:
        t = model[k]
        if not torch.equal(t, expected(k, t)):
            return False
    if what == "state":
        names = keys                 # the optimizer numbers parameters in the module's order
        st = got["optim"]["state"]
        for i in {0, len(names) // 2, len(names) - 1}:
            for m in ("exp_avg", "exp_avg_sq"):
                if not torch.equal(st[i][m], expected(f"{names[i]}.{m}", st[i][m])):
                    return False
            if float(st[i]["step"]) != STEP:
                return False
    return True


# -- /proc/self/status: resident and peak resident memory -----------------------------------------
def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def _reset_peak() -> bool:
    """Reset VmHWM to the current RSS (proc(5): writing 5 to /proc/PID/clear_refs)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5\n")
        return True
    except OSError:
        return False


class _Peak:
    """Peak RSS added by the block: VmHWM after it minus VmRSS before it (bytes)."""

    def __enter__(self) -> _Peak:
        self.reset = _reset_peak()
        self.before = _status_kib("VmRSS") * 1024
        self.hwm_before = _status_kib("VmHWM") * 1024
        return self

    def __exit__(self, *exc: object) -> None:
        hwm = _status_kib("VmHWM") * 1024
        # Without the reset, a peak before the block hides one inside it smaller than it: a lower bound.
        self.added = max(0, hwm - (self.before if self.reset else self.hwm_before))


# -- one measurement, in a fresh process -----------------------------------------------------------
def _cfg(root: str, model: str = MODEL) -> Any:
    from tiered_ckpt.config import NodeConfig

    return NodeConfig(root=root, model=model)      # every io setting at its default, as a user starts


def _fixture(spec: dict[str, Any], fill: bool) -> dict[str, Any]:
    if spec["what"] == "state":
        return build_state(spec["scale"], spec["small"], fill=fill)
    # Flat, name -> tensor, as a plain state_dict() is saved; names that sort differently from
    # their order ("p10" before "p2") show whether a load keeps the order saved.
    flat: dict[str, Any] = build_many(spec["many"], fill=fill)["model"]
    return flat


def _ckpt_meta(ckpt: Path) -> dict[str, int]:
    """Marker bytes, and index bytes: the largest metadata file (not a .bin data file) of the checkpoint,
    which is the one holding the per-tensor index whether the marker embeds it or points to it."""
    meta = [p.stat().st_size for p in ckpt.rglob("*") if p.is_file() and not p.name.endswith(".bin")]
    return {"marker_bytes": (ckpt / MARKER).stat().st_size, "index_bytes": max(meta, default=0),
            "meta_bytes": sum(meta)}


def _child(spec: dict[str, Any]) -> dict[str, Any]:
    import torch

    import tiered_ckpt as tc

    kind, who, what = spec["kind"], spec.get("who", "ours"), spec.get("what", "state")
    work = Path(spec["dir"])
    cfg = _cfg(str(work / "tiered"), f"{MODEL}-{what}")
    torch_file = work / "torch" / f"{what}.pt"
    res: dict[str, Any] = {}
    if kind == "save":
        t0 = time.perf_counter()
        state = _fixture(spec, fill=True)
        res["build_s"] = time.perf_counter() - t0
        res["bytes"], res["tensors"] = tensor_bytes(state)
        with _Peak() as peak:
            t = time.perf_counter()
            if who == "ours":
                r = tc.save(state, epoch=0, step=spec["step"], config=cfg)
            else:
                with open(torch_file, "wb") as f:
                    torch.save(state, f)
                    f.flush()
                    res["torch_save_only_s"] = time.perf_counter() - t
                    os.fsync(f.fileno())       # durable, as tc.save is when it returns
            res["seconds"] = time.perf_counter() - t
        res["rss_added"], res["rss_peak_reset"] = peak.added, peak.reset
        if who == "ours":
            res |= _ckpt_meta(Path(r.path))
    elif kind == "load":
        want = list(key_paths(_fixture(spec, fill=False)))      # torch.empty: no memory touched
        t = time.perf_counter()
        if who == "ours":
            got = tc.load(config=cfg)          # the newest committed: scans the markers, allocates new tensors
        else:
            got = torch.load(torch_file, weights_only=True)
        res["seconds"] = time.perf_counter() - t
        res["bytes"], res["tensors"] = tensor_bytes(got)
        res["key_order"] = list(key_paths(got)) == want
        res["same_keys"] = sorted(key_paths(got)) == sorted(want)
        res["verified"] = check_loaded(what, got)
    elif kind == "latest":
        lcfg = _cfg(str(work / "latest"), MODEL)
        t = time.perf_counter()
        info = tc.latest(config=lcfg)
        res["seconds"] = time.perf_counter() - t
        res["found"] = info.name if info is not None else None
    elif kind == "async":
        res |= _async(spec, cfg)
    elif kind == "async_small":
        small = {"w": torch.ones(1024)}            # 4 KiB
        with _Peak() as peak:
            t = time.perf_counter()
            h = tc.async_save(small, epoch=0, step=spec["step"], config=cfg)
            res["blocked_s"] = time.perf_counter() - t
            h.wait()
            res["total_s"] = time.perf_counter() - t
        res["rss_added"], res["rss_peak_reset"] = peak.added, peak.reset
    else:
        raise ValueError(kind)
    return res


def _memcpy_GBps(nbytes: int) -> float:
    """Host memory-copy bandwidth with the staging copy's own thread count (min(io.threads, cores))
    and code (GIL-free memmoves in pieces, io.pools.memmove_all) between two resident buffers."""
    import torch

    from tiered_ckpt.io import pools

    threads = min(IoConfig().threads, os.cpu_count() or 1)
    n = max(64 << 20, min(nbytes, GIB))
    src, dst = torch.ones(n, dtype=torch.uint8), torch.zeros(n, dtype=torch.uint8)   # both resident
    best = float("inf")
    for _ in range(3):
        t = time.perf_counter()
        pools.memmove_all([(dst.data_ptr(), src.data_ptr(), n)], threads)
        best = min(best, time.perf_counter() - t)
    return n / best / 1e9


def _train_rate(seconds: float, until: Callable[[], bool] | None = None) -> tuple[float, int]:
    """Iterations/s of a CPU-bound loop (small matmuls plus Python, as a training step's host side)."""
    import torch

    x, w = torch.rand(128, 128), torch.rand(128, 128) / 128
    n, t0 = 0, time.perf_counter()
    while True:
        x = torch.tanh(x @ w)
        sum(range(200))
        n += 1
        el = time.perf_counter() - t0
        if (until() if until is not None else el >= seconds):
            return n / el, n


def _async(spec: dict[str, Any], cfg: Any) -> dict[str, Any]:
    import tiered_ckpt as tc

    state = build_state(spec["scale"], spec["small"], fill=True)
    nbytes, _ = tensor_bytes(state)
    out: dict[str, Any] = {"bytes": nbytes, "memcpy_GBps": _memcpy_GBps(nbytes)}
    out["floor_s"] = nbytes / out["memcpy_GBps"] / 1e9
    base0, _ = _train_rate(2.0)
    out["blocked_s"], out["total_s"] = [], []
    for k in range(2):                       # the 1st pays for any staging allocation; the 2nd is steady state
        t = time.perf_counter()
        h = tc.async_save(state, epoch=0, step=spec["step"] + k, config=cfg)
        out["blocked_s"].append(time.perf_counter() - t)
        if k == 1:
            rate, iters = _train_rate(0.0, until=h.done)
            out["train_rate_bg"], out["train_iters_bg"] = rate, iters
        h.wait()
        out["total_s"].append(time.perf_counter() - t)
    # A 3rd save with nothing else running: the background write's CPU (user + system, every
    # thread; this thread only waits) per GB written.
    h = tc.async_save(state, epoch=0, step=spec["step"] + 2, config=cfg)
    c = cpu_seconds()
    h.wait()
    out["bg_cpu_s_per_GB"] = (cpu_seconds() - c) / (nbytes / 1e9)
    base1, _ = _train_rate(2.0)
    out["train_rate_base"] = (base0 + base1) / 2
    out["train_throughput"] = out["train_rate_bg"] / out["train_rate_base"]
    return out


# -- the parent: fixtures on disk, rounds, cache, cleanup ----------------------------------------
def _cold(work: Path, enabled: bool) -> str:
    """Drop the page cache before a measurement: 'dropped', 'fadvise' (not root), or 'warm'."""
    if not enabled:
        return "warm"
    if drop_caches():
        return "dropped"
    os.sync()
    for p in work.rglob("*"):
        if p.is_file():
            try:
                fd = os.open(p, os.O_RDONLY)
            except OSError:
                continue
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
    return "fadvise"


def _run_child(spec: dict[str, Any], timeout: float) -> dict[str, Any]:
    env = os.environ.copy()
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO / "src"), str(REPO), env.get("PYTHONPATH")) if p)
    p = subprocess.run([sys.executable, "-m", "benchmarks.scale_bench", "--child", json.dumps(spec)],
                       capture_output=True, text=True, cwd=REPO, env=env, timeout=timeout)
    if p.returncode != 0:
        raise RuntimeError(f"scale bench child {spec['kind']} {spec.get('who', '')} failed:\n{p.stderr[-4000:]}")
    d: dict[str, Any] = json.loads(p.stdout.strip().splitlines()[-1])
    return d


def replicate(ckpt: Path, kept: int) -> list[Path]:
    """`kept` - 1 more committed copies of one real checkpoint, steps 2..kept, beside it.

    Data and index files are hard links (no bytes copied); each copy gets the marker rewritten with
    its own step, since a marker must name the directory it is in. What latest() reads is then what
    `kept` real saves of the same state leave.
    """
    try:
        import orjson
        loads: Callable[[bytes], Any] = orjson.loads
        dumps: Callable[[Any], bytes] = orjson.dumps
    except ImportError:
        loads, dumps = json.loads, lambda d: json.dumps(d).encode()
    marker = loads((ckpt / MARKER).read_bytes())
    made = []
    for step in range(2, kept + 1):
        dst = ckpt.parent / f"global_epoch0_step{step}"
        dst.mkdir()
        for p in ckpt.iterdir():
            if p.is_file() and p.name != MARKER:
                os.link(p, dst / p.name)
        (dst / MARKER).write_bytes(dumps(marker | {"step": step}))
        made.append(dst)
    return made


def run(args: argparse.Namespace, progress: Callable[[str], None],
        runner: Callable[[dict[str, Any], float], dict[str, Any]] | None = None) -> dict[str, Any]:
    """All rounds; `runner` runs one measurement (default: a fresh process, `_run_child`)."""
    runner = runner or _run_child
    work = Path(args.dir).resolve()
    shutil.rmtree(work, ignore_errors=True)
    for d in ("tiered", "torch", "fio", "latest"):
        (work / d).mkdir(parents=True)
    base = {"dir": str(work), "scale": args.scale, "small": args.small, "many": args.many}
    cache: set[str] = set()
    t_all = time.monotonic()
    rounds: list[dict[str, Any]] = []
    facts: dict[str, Any] = {}
    r = 0

    def measure(label: str, spec: dict[str, Any], timeout: float | None = None) -> dict[str, Any]:
        cache.add(_cold(work, args.drop_caches))
        t = time.monotonic()
        res = runner(base | spec, timeout or args.timeout)
        fig = (f"blocked {res['blocked_s'][1]:.2f} s (floor {res['floor_s']:.2f} s)" if spec["kind"] == "async"
               else f"{res['blocked_s']:.3f} s" if spec["kind"] == "async_small"
               else f"{res['seconds']:.2f} s" if "bytes" not in res or spec.get("what") == "many"
               else f"{res['bytes'] / res['seconds'] / 1e9:.2f} GB/s in {res['seconds']:.2f} s")
        progress(f"[scale round {r + 1}/{args.rounds}] {label}: {fig} ({time.monotonic() - t:.0f} s wall)")
        if res.get("verified") is False:
            raise RuntimeError(f"{label}: the loaded state does not match what was saved")
        return res

    def clean() -> None:
        for d in ("tiered", "torch"):
            shutil.rmtree(work / d, ignore_errors=True)
            (work / d).mkdir()

    try:
        # The kept checkpoints for latest(): one real save of --many tensors, then copies (untimed).
        t = time.monotonic()
        (work / "lt" / "tiered").mkdir(parents=True)
        one = runner(base | {"kind": "save", "who": "ours", "what": "many", "step": 1, "dir": str(work / "lt")},
                     args.timeout)
        src = work / "lt" / "tiered" / f"{MODEL}-many" / "global_epoch0_step1"
        (work / "latest" / MODEL).mkdir()
        ckpt = work / "latest" / MODEL / src.name
        src.rename(ckpt)
        shutil.rmtree(work / "lt")
        replicate(ckpt, args.kept)
        progress(f"[scale] {args.kept} kept checkpoints of {args.many:,} tensors built in {time.monotonic() - t:.0f} s "
                 f"(marker {one['marker_bytes']:,} bytes each)")
        latest_timed_out = False
        step = 0
        for r in range(args.rounds):
            rd: dict[str, Any] = {}
            cache.add(_cold(work, args.drop_caches))
            fig = disk(work / "fio", _bytes_estimate(args.scale, args.small))
            rd["fio_runs"] = fig["runs"]
            for rw in ("write", "read"):
                # fio's best over queue depths and job counts (harness.disk); its own figure, so no wall variant
                rd[f"fio_{rw}"] = rd[f"fio_{rw}_wall"] = fig[rw]
                progress(f"[scale round {r + 1}/{args.rounds}] fio {rw}: {fig[rw]:.2f} GB/s (best: {fig['best_of'][rw]})")
            for what, label in (("state", "state"), ("many", f"{args.many:,} x 4 KiB")):
                step += 1
                for who in rotate(["ours", "torch"], r):
                    name = {"ours": "tc.save", "torch": "torch.save"}[who]
                    rd[f"{what}_save_{who}"] = measure(f"{name} {label}", {"kind": "save", "who": who, "what": what,
                                                                          "step": step})
                for who in rotate(["ours", "torch"], r):
                    name = {"ours": "tc.load", "torch": "torch.load"}[who]
                    rd[f"{what}_load_{who}"] = measure(f"{name} {label}", {"kind": "load", "who": who, "what": what})
                clean()
            # The same transformer-like state at a quarter the size (1 GiB at --scale 1), saved only:
            # per-save costs that a 4 GiB save hides.
            step += 1
            rd["small_state_save_ours"] = measure("tc.save state/4", {"kind": "save", "who": "ours", "what": "state",
                                                                     "scale": args.scale * SMALL_STATE, "step": step})
            clean()
            facts.update(bytes=rd["state_save_ours"]["bytes"], tensors=rd["state_save_ours"]["tensors"],
                         build_s=rd["state_save_ours"]["build_s"])
            if not latest_timed_out:
                try:
                    rd["latest"] = measure(f"tc.latest among {args.kept}", {"kind": "latest"}, LATEST_TIMEOUT)
                except subprocess.TimeoutExpired:
                    latest_timed_out = True
                    rd["latest"] = {"seconds": LATEST_TIMEOUT, "timed_out": True, "found": None}
                    progress(f"[scale round {r + 1}/{args.rounds}] tc.latest: over {LATEST_TIMEOUT:.0f} s, stopped "
                             "(not measured again in later rounds)")
                if rd["latest"]["found"] not in (None, f"global_epoch0_step{args.kept}"):
                    raise RuntimeError(f"latest() found {rd['latest']['found']}, not global_epoch0_step{args.kept}: "
                                       "it does not take replicate()'s copies for committed checkpoints "
                                       "(has the checkpoint format changed? see scale_bench.replicate)")
            step += 3
            rd["async"] = measure("async_save x3 + training loop", {"kind": "async", "step": step - 2})
            clean()
            step += 1
            rd["async_small"] = measure("first async_save of 4 KiB", {"kind": "async_small", "step": step})
            clean()
            rounds.append(rd)
    finally:
        shutil.rmtree(work, ignore_errors=True)     # gigabytes of checkpoints, also after a failure
    return summarize(rounds, facts, args, cache, time.monotonic() - t_all)


def _bytes_estimate(scale: float, small: int) -> int:
    n = 0
    for _, shape in layout(scale, small):
        k = 4
        for s in shape:
            k *= s
        n += k
    return 3 * n          # parameters, exp_avg, exp_avg_sq (each step counter is 4 bytes)


# -- summary and table ---------------------------------------------------------------------------
def _met(key: str, value: float) -> bool:
    op, goal = GOALS[key]
    return {">=": value >= goal, "<=": value <= goal, "<": value < goal, "==": value == goal}[op]


def summarize(rounds: list[dict[str, Any]], facts: dict[str, Any], args: argparse.Namespace, cache: set[str],
              wall: float) -> dict[str, Any]:
    per: dict[str, list[float]] = {}

    def add(key: str, value: float) -> None:
        per.setdefault(key, []).append(float(value))

    def gbps(res: dict[str, Any]) -> float:
        return float(res["bytes"] / res["seconds"] / 1e9)

    order_ok = True
    for rd in rounds:
        for k in ("fio_write", "fio_read", "fio_write_wall", "fio_read_wall"):
            add(k + "_GBps", rd[k])
        for who in ("ours", "torch"):
            add(f"write_{who}_GBps", gbps(rd[f"state_save_{who}"]))
            add(f"load_{who}_GBps", gbps(rd[f"state_load_{who}"]))
            add(f"many_save_{who}_s", rd[f"many_save_{who}"]["seconds"])
            add(f"many_load_{who}_s", rd[f"many_load_{who}"]["seconds"])
            add(f"many_rss_{who}", rd[f"many_save_{who}"]["rss_added"])
        add("torch_save_only_many_s", rd["many_save_torch"]["torch_save_only_s"])
        add("write_vs_fio", gbps(rd["state_save_ours"]) / rd["fio_write"])
        add("write_vs_fio_wall", gbps(rd["state_save_ours"]) / rd["fio_write_wall"])
        add("write_1g_ours_GBps", gbps(rd["small_state_save_ours"]))
        add("write_1g_vs_fio", gbps(rd["small_state_save_ours"]) / rd["fio_write"])
        add("small_state_bytes", rd["small_state_save_ours"]["bytes"])
        add("torch_write_vs_fio", gbps(rd["state_save_torch"]) / rd["fio_write"])
        add("load_vs_fio", gbps(rd["state_load_ours"]) / rd["fio_read"])
        add("load_vs_fio_wall", gbps(rd["state_load_ours"]) / rd["fio_read_wall"])
        add("torch_load_vs_fio", gbps(rd["state_load_torch"]) / rd["fio_read"])
        add("many_save_vs_torch", rd["many_save_ours"]["seconds"] / rd["many_save_torch"]["seconds"])
        add("many_load_vs_torch", rd["many_load_ours"]["seconds"] / rd["many_load_torch"]["seconds"])
        ms = rd["many_save_ours"]
        add("many_index_bytes", ms["index_bytes"])
        add("many_rss_vs_index", ms["rss_added"] / max(1, ms["index_bytes"]))
        add("marker_state_bytes", rd["state_save_ours"]["marker_bytes"])
        add("marker_many_bytes", ms["marker_bytes"])
        if "latest" in rd:
            add("latest_s", rd["latest"]["seconds"])
        a = rd["async"]
        add("async_blocked_1_s", a["blocked_s"][0])
        add("async_blocked_2_s", a["blocked_s"][1])
        add("async_total_2_s", a["total_s"][1])
        add("async_floor_s", a["floor_s"])
        add("memcpy_GBps", a["memcpy_GBps"])
        add("async_block_vs_floor", a["blocked_s"][1] / a["floor_s"])
        add("train_throughput", a["train_throughput"])
        add("bg_cpu_s_per_GB", a["bg_cpu_s_per_GB"])
        add("small_async_s", rd["async_small"]["blocked_s"])
        add("small_async_rss", rd["async_small"]["rss_added"])
        for w in ("state", "many"):
            order_ok = order_ok and rd[f"{w}_load_ours"]["key_order"]
    add("key_order", 1.0 if order_ok else 0.0)
    summary = {k: stats(v) for k, v in per.items()}
    met = {k: _met(k, summary[k]["median"]) for k in GOALS}
    latest_timed_out = any(rd.get("latest", {}).get("timed_out") for rd in rounds)
    cold = "warm" if "warm" in cache else "fadvise" if "fadvise" in cache else "dropped"
    return {"dir": str(Path(args.dir).resolve()), "scale": args.scale, "state_bytes": facts["bytes"],
            "state_tensors": facts["tensors"], "small": args.small, "many": args.many, "kept": args.kept,
            "rounds": args.rounds, "cache": cold, "latest_timed_out": latest_timed_out,
            "torch_loaded_key_order": all(rd[f"{w}_load_torch"]["key_order"] for rd in rounds for w in ("state", "many")),
            "goals": {k: list(v) for k, v in GOALS.items()}, "met": met, "stats": summary, "rounds_raw": rounds,
            "seconds": wall, "build_s": facts["build_s"]}


def _rng(st: dict[str, dict[str, float]], key: str, fmt: str = ".2f", unit: str = "", div: float = 1.0) -> str:
    s = st[key]
    lo, mid, hi = s["min"] / div, s["median"] / div, s["max"] / div
    return f"{mid:{fmt}}{unit}" if lo == hi else f"{mid:{fmt}}{unit} ({lo:{fmt}}-{hi:{fmt}})"


def _goal_text(key: str, unit: str = "", div: float = 1.0) -> str:
    op, goal = GOALS[key]
    return f"{op} {goal / div:g}{unit}"


def rows(res: dict[str, Any]) -> list[tuple[str, str, str, bool | None]]:
    """(goal, measured: median (min-max) and what it is against, threshold, met) per table row."""
    st, met = res["stats"], res["met"]
    kib, mib = 1 << 10, 1 << 20
    many = f"{res['many']:,} x 4 KiB"
    late = (f"> {LATEST_TIMEOUT:.0f} s (stopped; not rerun)" if res["latest_timed_out"] and "latest_s" in st
            and st["latest_s"]["median"] >= LATEST_TIMEOUT else _rng(st, "latest_s", fmt=".3f", unit=" s"))
    return [
        ("1. write vs fio (tc.save, call to return)", f"{_rng(st, 'write_vs_fio', unit='x')}: {_rng(st, 'write_ours_GBps')} vs "
         f"fio {_rng(st, 'fio_write_GBps')} GB/s (fio wall {_rng(st, 'fio_write_wall_GBps')})",
         _goal_text("write_vs_fio", "x"), met["write_vs_fio"]),
        (f"1. write vs fio, state/4 ({st['small_state_bytes']['median'] / GIB:.2f} GiB)",
         f"{_rng(st, 'write_1g_vs_fio', unit='x')}: {_rng(st, 'write_1g_ours_GBps')} vs fio {_rng(st, 'fio_write_GBps')} GB/s",
         _goal_text("write_1g_vs_fio", "x"), met["write_1g_vs_fio"]),
        ("   torch.save + fsync vs fio (context)", f"{_rng(st, 'torch_write_vs_fio', unit='x')}: {_rng(st, 'write_torch_GBps')} GB/s",
         "", None),
        ("1. load into new tensors vs fio (tc.load)", f"{_rng(st, 'load_vs_fio', unit='x')}: {_rng(st, 'load_ours_GBps')} vs "
         f"fio {_rng(st, 'fio_read_GBps')} GB/s (fio wall {_rng(st, 'fio_read_wall_GBps')})",
         _goal_text("load_vs_fio", "x"), met["load_vs_fio"]),
        ("   torch.load vs fio (context)", f"{_rng(st, 'torch_load_vs_fio', unit='x')}: {_rng(st, 'load_torch_GBps')} GB/s", "", None),
        (f"2. save {many} vs torch.save + fsync", f"{_rng(st, 'many_save_vs_torch', unit='x')}: {_rng(st, 'many_save_ours_s', unit=' s')} "
         f"vs {_rng(st, 'many_save_torch_s', unit=' s')} (torch.save alone {_rng(st, 'torch_save_only_many_s', unit=' s')})",
         _goal_text("many_save_vs_torch", "x"), met["many_save_vs_torch"]),
        (f"2. load {many} vs torch.load", f"{_rng(st, 'many_load_vs_torch', unit='x')}: {_rng(st, 'many_load_ours_s', unit=' s')} "
         f"vs {_rng(st, 'many_load_torch_s', unit=' s')}", _goal_text("many_load_vs_torch", "x"), met["many_load_vs_torch"]),
        (f"2. RSS added saving {many} vs index size", f"{_rng(st, 'many_rss_vs_index', unit='x')}: "
         f"{_rng(st, 'many_rss_ours', fmt='.0f', unit=' MiB', div=mib)} vs index {_rng(st, 'many_index_bytes', fmt='.1f', unit=' MiB', div=mib)} "
         f"(torch.save {_rng(st, 'many_rss_torch', fmt='.0f', unit=' MiB', div=mib)})",
         _goal_text("many_rss_vs_index", "x"), met["many_rss_vs_index"]),
        ("3. marker size, transformer state", _rng(st, "marker_state_bytes", fmt=",.1f", unit=" KiB", div=kib),
         _goal_text("marker_state_bytes", " KiB", kib), met["marker_state_bytes"]),
        (f"3. marker size, {many}", _rng(st, "marker_many_bytes", fmt=",.1f", unit=" KiB", div=kib),
         _goal_text("marker_many_bytes", " KiB", kib), met["marker_many_bytes"]),
        (f"3. latest() among {res['kept']} x {res['many']:,} tensors", late, _goal_text("latest_s", " s"), met["latest_s"]),
        ("4. async_save blocked (2nd) vs memcpy floor", f"{_rng(st, 'async_block_vs_floor', unit='x')}: "
         f"{_rng(st, 'async_blocked_2_s', unit=' s')} vs {_rng(st, 'async_floor_s', unit=' s')} "
         f"(memcpy {_rng(st, 'memcpy_GBps', fmt='.1f')} GB/s; 1st save {_rng(st, 'async_blocked_1_s', unit=' s')})",
         _goal_text("async_block_vs_floor", "x"), met["async_block_vs_floor"]),
        ("4. training loop during the background write", f"{_rng(st, 'train_throughput', fmt='.0%')} of its rate without "
         f"(write done {_rng(st, 'async_total_2_s', unit=' s')} after the call)",
         f">= {GOALS['train_throughput'][1]:.0%}", met["train_throughput"]),
        ("4. background write's CPU per GB written", _rng(st, "bg_cpu_s_per_GB", fmt=".2f", unit=" s"),
         _goal_text("bg_cpu_s_per_GB", " s"), met["bg_cpu_s_per_GB"]),
        ("4. first async_save of a 4 KiB tensor: RSS added", f"{_rng(st, 'small_async_rss', fmt='.1f', unit=' MiB', div=mib)} "
         f"(call to return {_rng(st, 'small_async_s', fmt='.3f', unit=' s')})",
         _goal_text("small_async_rss", " MiB", mib), met["small_async_rss"]),
        ("5. loaded keys in the order saved", "yes" if st["key_order"]["median"] == 1 else "no (NOT the order saved)",
         "every level, both states", met["key_order"]),
    ]


def render(res: dict[str, Any]) -> str:
    gib = res["state_bytes"] / GIB
    scaled = res["state_bytes"] < ISSUE_STATE * 0.9 or res["many"] < ISSUE_MANY or res["kept"] < ISSUE_KEPT
    cache = {"dropped": "page cache dropped before each (sync; drop_caches)",
             "fadvise": "page cache evicted per file (posix_fadvise DONTNEED; not root)",
             "warm": "PAGE CACHE NOT DROPPED (--no-drop-caches): warm-cache figures"}[res["cache"]]
    lines = [
        f"SCALE STATE: {gib:.2f} GiB in {res['state_tensors']:,} tensors (transformer-like + AdamW moments, "
        f"--scale {res['scale']:g}); per-tensor test {res['many']:,} x 4 KiB; latest() among {res['kept']} kept"
        + (f"; SCALED DOWN from the issue's fixture ({ISSUE_STATE / GIB:.0f} GiB state, {ISSUE_MANY:,} tensors, "
           f"{ISSUE_KEPT} kept)" if scaled else ""),
        f"on {res['dir']}: fresh process per figure, call to return, fsync included, {cache}; "
        f"median (min-max) of {res['rounds']} interleaved rounds, ratios within a round",
    ]
    table = rows(res)
    head = ("goal", "measured", "threshold")
    text = [(a, b, c) for a, b, c, _ in table]
    w = [max(len(h), *(len(row[i]) for row in text)) for i, h in enumerate(head)]
    lines.append("  ".join(f"{h:<{w[i]}}" for i, h in enumerate(head)))
    for *cells, ok in table:
        verdict = "" if ok is None else ("met" if ok else "NOT MET")
        lines.append(("  ".join(f"{c:<{w[i]}}" for i, c in enumerate(cells)) + f"  {verdict}").rstrip())
    if not res["torch_loaded_key_order"]:
        lines.append("note: torch.load did not return the keys in the order saved either")
    lines.append(f"({res['seconds']:.0f} s; building the state took {res['build_s']:.1f} s per process, outside the timing)")
    return "\n".join(lines)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    env = os.environ.get
    ap = argparse.ArgumentParser(prog="python -m benchmarks scale", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--scale", type=float, default=float(env("BENCH_SCALE", str(DEFAULT_SCALE))),
                    help=f"state size as a fraction of the issue's ~4 GiB (default {DEFAULT_SCALE:g})")
    ap.add_argument("--small", type=int, default=int(env("BENCH_SCALE_SMALL", str(DEFAULT_SMALL))),
                    help="parameters of 4-64 KiB in the transformer-like state")
    ap.add_argument("--many", type=int, default=int(env("BENCH_SCALE_MANY", str(ISSUE_MANY))),
                    help="count of 4 KiB tensors in the per-tensor test and in each kept checkpoint")
    ap.add_argument("--kept", type=int, default=int(env("BENCH_SCALE_KEPT", str(ISSUE_KEPT))),
                    help="kept checkpoints latest() chooses among")
    ap.add_argument("--rounds", type=int, default=int(env("BENCH_SCALE_ROUNDS", str(DEFAULT_ROUNDS))))
    ap.add_argument("--dir", default=env("BENCH_SCALE_DIR", str(REPO / ".bench" / "scale")))
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds one measurement may take")
    ap.add_argument("--no-drop-caches", dest="drop_caches", action="store_false",
                    help="leave the page cache alone (a smoke run on a shared machine; figures are then warm-cache)")
    ap.add_argument("--json", action="store_true", help="print the results as one JSON object instead of the table")
    ap.add_argument("--quick", action="store_true", help="tiny sizes, one round (a smoke run)")
    args, _ = ap.parse_known_args(argv)    # `python -m benchmarks` hands every suite the same arguments
    if args.quick:
        args.scale, args.small, args.many, args.kept, args.rounds = 0.005, 50, 1000, 10, 1
    if not 0 < args.scale <= 16 or args.rounds < 1 or args.many < 1 or args.small < 0 or args.kept < 1:
        ap.error("--scale must be in (0, 16], --rounds, --many and --kept >= 1, --small >= 0")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if tools_missing("the scale benchmark saves torch state dicts and compares with torch.save"):
        return BENCH_ERROR
    est = _bytes_estimate(args.scale, args.small)
    print(f"scale benchmark: state ~{est / GIB:.2f} GiB, {args.rounds} rounds, {args.many:,} x 4 KiB, "
          f"latest() among {args.kept}, on {Path(args.dir).resolve()}", file=sys.stderr, flush=True)
    try:
        res = run(args, lambda line: print(line, file=sys.stderr, flush=True))
    except (RuntimeError, subprocess.SubprocessError, OSError) as e:
        print(f"scale benchmark failed: {e}", file=sys.stderr)
        return BENCH_ERROR
    res["table"] = [dict(zip(("goal", "measured", "threshold", "met"), row, strict=True)) for row in rows(res)]
    return report(res, REPO / ".bench" / "scale_results.json", args.json, render)

if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--child":
        print(json.dumps(_child(json.loads(sys.argv[2]))))
        sys.exit(0)
    sys.exit(1 if main(sys.argv[1:]) == BENCH_ERROR else 0)      # a missed goal is not a failed command
