"""tc.save and tc.load of a transformer-like state against fio writing and reading the same bytes.

`measure_rw` is what the benchmark suite calls; run alone it prints its figures:

    python -m benchmarks.rw_bench [--scale 0.25] [--rounds 3] [--dir .bench/rw] [--no-drop-caches] [--json]

The state (`build`, the same in every process): a model of 4 GiB of fp32 parameters at scale 1.0
laid out as benchmarks/dcp_bench.layout lays it out (three 512 MiB embedding-like matrices, ~130
layer matrices of 16 and 24 MiB, 1,000 tensors of 4-64 KiB, a norm), and its AdamW state as
torch.optim.AdamW.state_dict() holds it: per parameter a 0-dim `step` tensor (4 bytes: every
buffer after it starts off the 4 KiB grid), `exp_avg` and `exp_avg_sq`, plus `param_groups`.
12 GiB in all at scale 1.0; `scale` multiplies the parameter bytes.

Each measurement runs in a fresh process after `sync` and dropping the page cache (needs root;
the result says whether it could), timed from the call to its return:
  * fio write then read of the state's byte count (benchmarks.io_bench._fio: 4 jobs, 16 MiB
    blocks, O_DIRECT, end_fsync): fio's own figure and its wall clock (process start to exit);
  * tc.save(state) with the default I/O options (commit, fsync and hashing included);
  * tc.load() of it into new tensors (the loaded state is then spot-checked, untimed).
Rounds alternate the order (fio first, then ours; ours first, then fio); ratios are taken within
a round, then medians and min-max ranges are returned.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
FULL_PARAMS = 4 << 30          # parameter bytes at scale 1.0
SMALL_TENSORS = 1000
FIO_JOBS, FIO_BLOCK = 4, 16 << 20
MODEL = "rw"
GOALS = {"save_vs_fio": 0.95, "load_vs_fio": 0.95}


def build(scale: float, fill: bool = True) -> dict[str, Any]:
    """{"model": {fqn: tensor}, "optim": {"state": {fqn: {step, exp_avg, exp_avg_sq}}, "param_groups": [...]}}."""
    import torch

    from benchmarks.dcp_bench import _fill, _seed, layout

    model: dict[str, Any] = {}
    state: dict[str, Any] = {}
    for name, shape in layout(int(FULL_PARAMS * scale), SMALL_TENSORS):
        p = model[name] = torch.empty(shape)
        m, v = torch.empty(shape), torch.empty(shape)
        if fill:
            _fill(p, _seed(name))
            _fill(m, _seed(name + ".exp_avg"))
            _fill(v, _seed(name + ".exp_avg_sq"))
        state[name] = {"step": torch.tensor(1000.0), "exp_avg": m, "exp_avg_sq": v}
    groups = [{"lr": 1e-4, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.01, "amsgrad": False,
               "params": list(model)}]
    return {"model": model, "optim": {"state": state, "param_groups": groups}}


def state_bytes(state: Any) -> int:
    import torch

    if isinstance(state, torch.Tensor):
        return int(state.numel() * state.element_size())
    if isinstance(state, dict):
        return sum(state_bytes(v) for v in state.values())
    if isinstance(state, list):
        return sum(state_bytes(v) for v in state)
    return 0


def _check(got: dict[str, Any]) -> bool:
    """Spot check of a loaded state (untimed): a few tensors of the model and of the moments."""
    import torch

    from benchmarks.dcp_bench import expected

    keys = list(got["model"])
    for k in {keys[0], keys[len(keys) // 2], keys[-1], keys[len(keys) // 3]}:
        if not torch.equal(got["model"][k], expected(k, got["model"][k])):
            return False
        st = got["optim"]["state"][k]
        if not torch.equal(st["exp_avg_sq"], expected(k + ".exp_avg_sq", st["exp_avg_sq"])):
            return False
        if float(st["step"]) != 1000.0:
            return False
    return True


def _child(spec: dict[str, Any]) -> dict[str, Any]:
    import torch  # noqa: F401 - a training process has torch loaded; its import is not the load's time

    import tiered_ckpt as tc
    from tiered_ckpt.config import NodeConfig

    cfg = NodeConfig(root=spec["root"], model=MODEL)
    if spec["what"] == "save":
        state = build(spec["scale"])
        n = state_bytes(state)
        t = time.perf_counter()
        res = tc.save(state, epoch=0, step=spec["step"], config=cfg)
        took = time.perf_counter() - t
        return {"bytes": n, "seconds": took, "direct": res.direct, "files": res.files}
    t = time.perf_counter()
    got = tc.load(config=cfg)
    took = time.perf_counter() - t
    return {"bytes": state_bytes(got), "seconds": took, "verified": _check(got)}


def _run_child(spec: dict[str, Any], timeout: float = 1800) -> dict[str, Any]:
    env = os.environ.copy()
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO / "src"), str(REPO), env.get("PYTHONPATH")) if p)
    p = subprocess.run([sys.executable, "-m", "benchmarks.rw_bench", "--child", json.dumps(spec)],
                       capture_output=True, text=True, cwd=REPO, env=env, timeout=timeout)
    if p.returncode != 0:
        raise RuntimeError(f"rw bench child {spec['what']} failed:\n{p.stderr[-4000:]}")
    d: dict[str, Any] = json.loads(p.stdout.strip().splitlines()[-1])
    return d


def _drop_caches() -> bool:
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("1\n")
        return True
    except OSError:
        return False


def _stats(xs: list[float]) -> dict[str, float]:
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs)}


def measure_rw(tmp: Path, fixture: str = "transformer", scale: float = 1.0, rounds: int = 3,
               drop_caches: bool = True) -> dict[str, Any]:
    """Save and load of the transformer-like state vs fio on `tmp`, `rounds` interleaved rounds.

    Returns {"bytes", "tensors", "rounds": [per-round figures], "cold_cache", and per figure
    ("fio_write", "fio_write_wall", "save", "fio_read", "fio_read_wall", "load" in GB/s;
    "save_vs_fio", "load_vs_fio", "save_vs_fio_wall", "load_vs_fio_wall" as ratios) its
    {"median", "min", "max"}, "goals" and "met"}. Ratios against fio are against fio's own
    figure; the _wall ones against fio's wall clock. `tmp` is emptied and left empty.
    """
    from benchmarks.io_bench import _fio

    if fixture != "transformer":
        raise ValueError(f"fixture {fixture!r}: only 'transformer' is built")
    if shutil.which("fio") is None:
        raise RuntimeError("fio not found: run `make install` (installs Debian's fio)")
    work = Path(tmp).resolve()
    shutil.rmtree(work, ignore_errors=True)
    (work / "fio").mkdir(parents=True)
    (work / "ckpt").mkdir()
    meta = build(scale, fill=False)
    nbytes = state_bytes(meta)
    ntensors = sum(1 for _ in _tensors(meta))
    del meta
    fio_size = max(FIO_JOBS * FIO_BLOCK, nbytes // (FIO_JOBS * FIO_BLOCK) * FIO_JOBS * FIO_BLOCK)
    cold = True
    per: list[dict[str, Any]] = []

    def drop() -> None:
        nonlocal cold
        cold = (_drop_caches() if drop_caches else False) and cold

    def fio(rw: str) -> tuple[float, float]:
        drop()
        t = time.monotonic()
        own = _fio(work / "fio", rw, fio_size, FIO_JOBS, FIO_BLOCK)
        return own, fio_size / (time.monotonic() - t) / 1e9

    try:
        for r in range(rounds):
            rd: dict[str, Any] = {}
            ours_first = r % 2 == 1
            if not ours_first:
                rd["fio_write"], rd["fio_write_wall"] = fio("write")
            drop()
            s = _run_child({"what": "save", "root": str(work / "ckpt"), "scale": scale, "step": r})
            rd["save"], rd["direct"] = s["bytes"] / s["seconds"] / 1e9, s["direct"]
            if ours_first:
                rd["fio_write"], rd["fio_write_wall"] = fio("write")
                rd["fio_read"], rd["fio_read_wall"] = fio("read")
            drop()
            ld = _run_child({"what": "load", "root": str(work / "ckpt"), "scale": scale})
            if not ld["verified"]:
                raise RuntimeError("the loaded state does not match what was saved")
            rd["load"] = ld["bytes"] / ld["seconds"] / 1e9
            if not ours_first:
                rd["fio_read"], rd["fio_read_wall"] = fio("read")
            for leftover in (work / "fio").iterdir():
                leftover.unlink()
            shutil.rmtree(work / "ckpt" / MODEL, ignore_errors=True)
            for w, rw in (("save", "write"), ("load", "read")):
                rd[f"{w}_vs_fio"] = rd[w] / rd[f"fio_{rw}"]
                rd[f"{w}_vs_fio_wall"] = rd[w] / rd[f"fio_{rw}_wall"]
            per.append(rd)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    keys = ("fio_write", "fio_write_wall", "save", "fio_read", "fio_read_wall", "load",
            "save_vs_fio", "load_vs_fio", "save_vs_fio_wall", "load_vs_fio_wall")
    out: dict[str, Any] = {"fixture": fixture, "scale": scale, "bytes": nbytes, "tensors": ntensors,
                           "fio_bytes": fio_size, "cold_cache": cold, "rounds": per}
    out |= {k: _stats([rd[k] for rd in per]) for k in keys}
    out["goals"] = GOALS
    out["met"] = {k: out[k]["median"] >= g for k, g in GOALS.items()}
    return out


def _tensors(obj: Any) -> Any:
    import torch

    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from _tensors(v)
    elif isinstance(obj, list):
        for v in obj:
            yield from _tensors(v)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.rw_bench", description=__doc__.splitlines()[0])
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--scale", type=float, default=float(os.environ.get("BENCH_RW_SCALE", "1.0")))
    ap.add_argument("--rounds", type=int, default=int(os.environ.get("BENCH_RW_ROUNDS", "3")))
    ap.add_argument("--dir", default=os.environ.get("BENCH_RW_DIR", str(REPO / ".bench" / "rw")))
    ap.add_argument("--no-drop-caches", dest="drop_caches", action="store_false")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    if args.child:
        print(json.dumps(_child(json.loads(args.child))))
        return 0
    res = measure_rw(Path(args.dir), scale=args.scale, rounds=args.rounds, drop_caches=args.drop_caches)
    if args.json:
        print(json.dumps(res, indent=1))
        return 0
    print(f"{res['bytes'] / 1e9:.2f} GB in {res['tensors']} tensors, {args.rounds} rounds, "
          f"{'cold cache' if res['cold_cache'] else 'PAGE CACHE NOT DROPPED'}")
    for k in ("fio_write", "fio_write_wall", "save", "fio_read", "fio_read_wall", "load"):
        s = res[k]
        print(f"  {k:<16} {s['median']:.2f} GB/s ({s['min']:.2f}-{s['max']:.2f})")
    for k in ("save_vs_fio", "load_vs_fio", "save_vs_fio_wall", "load_vs_fio_wall"):
        s = res[k]
        goal = GOALS.get(k)
        met = "" if goal is None else (" met" if s["median"] >= goal else " NOT MET") + f" (goal >= {goal}x)"
        print(f"  {k:<16} {s['median']:.2f}x ({s['min']:.2f}-{s['max']:.2f}){met}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
