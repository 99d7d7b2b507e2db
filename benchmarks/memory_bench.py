"""Memory tier: caller-blocked save time vs the host memory-copy floor, and recovery from memory /
from the peer vs from the Lustre stand-in, side by side in one run; then a labelled projection
for the prod stack from the measured rates and the platform's physical figures.

    python -m benchmarks memory [--mib 512] [--rounds 3] [--quick] [--json]

Goals (docs/memory.md, issue 25):
  * caller-blocked time of save_training(tier="memory") <= 1.2 x the host memory-copy floor
    (cloning the same tensors into fresh host memory, measured here);
  * recovery (load_training) from the memory tier <= 0.5 x from the Lustre stand-in (a directory
    on this machine's disk, page cache dropped where allowed), and from the peer (a two-rank gloo
    job whose second node's memory was wiped) <= 1 x.
The peer and Lustre loads run as two processes (two simulated nodes), the memory load likewise,
so the three recoveries compare like with like.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks.harness import BENCH_ERROR, REPO, drop_caches, report

GIB = 1 << 30
# The prod stack (issue 25): 912 GiB checkpoint on 8 ND H100 v5 nodes; Microsoft's size docs and
# an Azure team's measurements: 52 GB/s device-to-host per GPU (8 per node), 8 x 400 Gb/s
# InfiniBand per node, AMLFS at 64 GB/s aggregate, Blob ~130 s for the 912 GiB.
PROD = {"checkpoint_gib": 912, "nodes": 8, "gpus_per_node": 8, "d2h_gbps_per_gpu": 52.0,
        "ib_gbps_per_node": 8 * 400 / 8, "amlfs_gbps": 64.0, "blob_seconds": 130.0}

# Goal per ratio (python -m benchmarks' table reads them): blocked time over the host-copy floor,
# recovery from memory and from the peer over recovery from the Lustre stand-in.
GOALS: dict[str, tuple[str, float]] = {"blocked_over_floor": ("<=", 1.2), "memory_over_lustre": ("<=", 0.5),
                                       "peer_over_lustre": ("<=", 1.0)}

_CHILD = r"""
import json, os, sys, time
from datetime import timedelta
import torch, torch.distributed as dist
A = json.loads(sys.argv[1])
rank, world = A["rank"], A["world"]
if world > 1:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{A['port']}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=300))
from tiered_ckpt import config as C, memory_tier
from tiered_ckpt.training import load_training, save_training
cfg = C.NodeConfig(root=A["root"], model="bench", memory=C.MemoryConfig(dir=A["mem"], persist_every=1000, timeout=300))
if not A["memory"]:
    cfg = C.NodeConfig(root=A["root"], model="bench-lustre")     # the same state, saved to the stand-in only
n = A["mib"] << 20
class M(torch.nn.Module):
    def __init__(self):
        super().__init__()
        k = 8
        self.ps = torch.nn.ParameterList(torch.nn.Parameter(torch.empty(n // 4 // k)) for _ in range(k))
m = M()
out = {}
# One-time costs (DCP's first plan, the toolkit's process groups) are paid before any clock starts.
w = torch.nn.Linear(2, 2)
warm = C.NodeConfig(root=A["root"], model="bench-warm")
if A["op"] == "save":
    save_training(w, epoch=0, step=1, config=warm)
    torch.manual_seed(0)
    for p in m.ps:
        p.data.normal_()
    save_training(m, epoch=0, step=0, config=cfg, tier="memory", persist=False)
    memory_tier.wait_background()
    floor = []
    blocked = []
    for i in range(A["rounds"]):
        t0 = time.perf_counter()
        copies = [p.detach().clone() for p in m.ps]
        floor.append(time.perf_counter() - t0)
        del copies
        t0 = time.perf_counter()
        save_training(m, epoch=0, step=i + 1, config=cfg, tier="memory", persist=False)
        blocked.append(time.perf_counter() - t0)
        memory_tier.wait_background()
    t0 = time.perf_counter()
    save_training(m, epoch=0, step=1, config=C.NodeConfig(root=A["root"], model="bench-lustre"))
    out.update(floor=min(floor), blocked=min(blocked), lustre_save=time.perf_counter() - t0)
else:
    load_training(w, config=warm)
    if A["memory"] and world > 1:
        memory_tier._comm(cfg, "agree")
    t0 = time.perf_counter()
    st = load_training(m, config=cfg)
    out.update(seconds=time.perf_counter() - t0, tier=st.tier, step=st.step)
print(json.dumps(out), flush=True)
os._exit(0)
"""


def _port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _run(op: str, world: int, root: Path, mems: list[Path], mib: int, rounds: int, memory: bool) -> list[dict[str, Any]]:
    port = _port()
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path), LOCAL_WORLD_SIZE="1")
    procs = [subprocess.Popen([sys.executable, "-c", _CHILD,
                               json.dumps({"rank": r, "world": world, "port": port, "root": str(root), "mem": str(mems[r]),
                                           "mib": mib, "rounds": rounds, "op": op, "memory": memory})],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=dict(env, GROUP_RANK=str(r)))
             for r in range(world)]
    outs = []
    for p in procs:
        o, e = p.communicate(timeout=1800)
        if p.returncode != 0:
            raise RuntimeError(f"memory bench child exited {p.returncode}: {e[-2000:]}")
        outs.append(json.loads(o.strip().splitlines()[-1]))
    return outs


def bench(mib: int, rounds: int, tmp: Path, shm: Path) -> dict[str, Any]:
    root = tmp / "lustre"
    root.mkdir()
    mems = [shm / "node0", shm / "node1"]
    for m in mems:
        m.mkdir()
    saved = _run("save", 2, root, mems, mib, rounds, True)
    load_mem = _run("load", 2, root, mems, mib, rounds, True)
    shutil.rmtree(mems[1])
    mems[1].mkdir()
    load_peer = _run("load", 2, root, mems, mib, rounds, True)
    dropped = drop_caches()
    load_lus = _run("load", 2, root, mems, mib, rounds, False)
    state = mib << 20
    floor, blocked = saved[0]["floor"], saved[0]["blocked"]
    t_mem = max(r["seconds"] for r in load_mem)
    t_peer = max(r["seconds"] for r in load_peer)
    t_lus = max(r["seconds"] for r in load_lus)
    tiers = {"memory": [r["tier"] for r in load_mem], "peer": [r["tier"] for r in load_peer],
             "lustre": [r["tier"] for r in load_lus]}
    res: dict[str, Any] = {
        "state_bytes_per_rank": state, "ranks": 2, "rounds": rounds, "page_cache_dropped": dropped,
        "host_copy_floor_s": floor, "memory_save_blocked_s": blocked, "blocked_over_floor": blocked / floor,
        "lustre_save_s": saved[0]["lustre_save"],
        "load_memory_s": t_mem, "load_peer_s": t_peer, "load_lustre_s": t_lus,
        "memory_over_lustre": t_mem / t_lus, "peer_over_lustre": t_peer / t_lus, "tiers": tiers,
    }
    res["goals"] = GOALS
    res["ratios"] = {k: res[k] for k in GOALS}
    res["met"] = {k: res[k] <= thr for k, (_, thr) in GOALS.items()}
    res["met"]["right_tiers"] = tiers == {"memory": ["memory", "memory"], "peer": ["memory", "peer"],
                                          "lustre": ["lustre", "lustre"]}
    res["projection"] = project(res)
    return res


def project(res: dict[str, Any]) -> dict[str, float]:
    """PROJECTION for the prod stack: per-node share over the platform's physical rates, each
    scaled by the overhead this run measured against its own floor (not measured on ND nodes)."""
    share = PROD["checkpoint_gib"] * GIB / PROD["nodes"]
    d2h = PROD["d2h_gbps_per_gpu"] * PROD["gpus_per_node"] * 1e9
    state = res["state_bytes_per_rank"]
    mem_read = state / res["load_memory_s"]               # bytes/s one rank restored from tmpfs here
    return {
        "node_share_gib": share / GIB,
        "gpu_to_host_s": share / d2h,
        "caller_blocked_s": share / d2h * res["blocked_over_floor"],
        "replica_over_ib_s": share / (PROD["ib_gbps_per_node"] * 1e9),
        "restore_from_memory_s": share / (mem_read * PROD["gpus_per_node"]),
        "persist_to_amlfs_s": PROD["checkpoint_gib"] * GIB / (PROD["amlfs_gbps"] * 1e9),
        "restore_from_blob_s": PROD["blob_seconds"],
    }


def render(res: dict[str, Any]) -> str:
    p = res["projection"]
    mib = res["state_bytes_per_rank"] >> 20
    lines = [
        f"memory tier, {res['ranks']} simulated nodes x 1 rank, {mib} MiB per rank, best of {res['rounds']}:",
        f"  caller blocked by save_training(tier='memory'): {res['memory_save_blocked_s']:.3f} s; host copy floor "
        f"{res['host_copy_floor_s']:.3f} s -> {res['blocked_over_floor']:.2f}x (goal <= 1.2x)",
        f"  recovery: memory {res['load_memory_s']:.3f} s, peer {res['load_peer_s']:.3f} s, Lustre stand-in "
        f"{res['load_lustre_s']:.3f} s{'' if res['page_cache_dropped'] else ' (page cache NOT dropped: no permission)'}"
        f" -> memory {res['memory_over_lustre']:.2f}x (goal <= 0.5x), peer {res['peer_over_lustre']:.2f}x (goal <= 1x)",
        f"  tiers reported: {res['tiers']}",
        "PROJECTION (not measured) for the prod stack, 912 GiB on 8 ND H100 v5 nodes "
        f"({p['node_share_gib']:.0f} GiB per node), from this run's overheads and the platform's figures:",
        f"  GPU -> host {p['gpu_to_host_s']:.2f} s at 8 x 52 GB/s; caller blocked ~{p['caller_blocked_s']:.2f} s; "
        f"replica to the peer over 8 x 400 Gb/s IB ~{p['replica_over_ib_s']:.2f} s (background)",
        f"  restore from memory ~{p['restore_from_memory_s']:.1f} s (8 ranks per node at this run's tmpfs read rate); "
        f"persist to AMLFS at 64 GB/s ~{p['persist_to_amlfs_s']:.1f} s (background); restore from Blob ~{p['restore_from_blob_s']:.0f} s",
        "  goals: " + ", ".join(f"{k}: {'met' if v else 'NOT met'}" for k, v in res["met"].items()),
    ]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="memory_bench", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mib", type=int, default=512, help="state per rank in MiB (default 512)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="small sizes (CI smoke run)")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--out", type=Path, default=REPO / ".bench" / "memory_results.json")
    args, _ = ap.parse_known_args(argv)
    if args.quick:
        args.mib, args.rounds = 32, 1
    try:
        import torch  # noqa: F401
    except ImportError:
        print("torch not installed: the memory bench saves through DCP (`make install` installs the pinned CPU torch)",
              file=sys.stderr)
        return BENCH_ERROR
    shm_base = Path("/dev/shm") if Path("/dev/shm").is_dir() else None
    with tempfile.TemporaryDirectory(prefix="memory-bench-") as tmp, \
            tempfile.TemporaryDirectory(prefix="memory-bench-", dir=shm_base) as shm:
        try:
            res = bench(args.mib, args.rounds, Path(tmp), Path(shm))
        except (RuntimeError, subprocess.TimeoutExpired) as e:
            print(f"memory bench could not run: {e}", file=sys.stderr)
            return BENCH_ERROR
    return report(res, args.out, args.json, render)


if __name__ == "__main__":
    sys.exit(main())
