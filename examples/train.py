"""A multi-node training job that checkpoints with tiered-ckpt and resumes by itself.

Launched by examples/train.sbatch as `srun torchrun ... examples/train.py`; torchrun sets RANK,
WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT for each worker (torch.distributed.elastic docs, "torchrun").

What it does, in order (docs/cluster.md explains why):
1. Process groups: NCCL for training on GPUs (gloo on CPU) and a separate gloo group for
   checkpoint coordination, so an async save's collectives never interleave with the training
   step's (torch.distributed.checkpoint.async_save runs its collectives in a background thread).
2. Resume: one rank (rank 0) runs `tiered-ckpt restore --latest --json`: it finds the newest
   committed checkpoint on either tier (Lustre or Blob) and makes it readable on Lustre (nothing to
   copy when resident; lfs hsm_restore when released; a download/import when only in Blob). The
   chosen name is broadcast and every rank loads it with TieredReader (dcp.load). No
   checkpoint anywhere: start at step 0.
3. Train; every --save-every steps an async DCP save through TieredWriter (thread mode); the
   previous save is waited for before the next one starts (one in flight, bounded memory).
   With the memory tier on (memory.dir in the node config) and --memory-every M, every M-th step
   in between is saved to node RAM with a peer replica (tiered_ckpt.memory_tier, docs/memory.md),
   and a restart first tries memory, then the peer, then step 2's restore.
4. SIGTERM (scancel, preemption, `scontrol requeue`, or the batch script forwarding the time-limit
   warning): every rank notes it; the ranks agree at the next step boundary (all_reduce MAX), wait
   for the save in flight, save the current step if it is newer, and exit 0. Slurm then requeues
   the job where it was asked to (--requeue), and the next start resumes from that checkpoint.

The job never runs retention: that is the login node's timer, once per cluster.

Configuration: the toolkit's node config (TIERED_CKPT_CONFIG, else /etc/tiered-ckpt/config.yaml):
root, model, naming, archive. Output: one `tiered-train: ...` line per event on rank 0's stdout.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType
from torch.nn.parallel import DistributedDataParallel

from tiered_ckpt import config as config_mod
from tiered_ckpt import memory_tier
from tiered_ckpt.dcp import TieredReader, TieredWriter
from tiered_ckpt.errors import EXIT_FAILED
from tiered_ckpt.naming import make_id, require_name

# What `tiered-ckpt restore --latest` says when neither tier holds a committed checkpoint
# (lifecycle/restore.py, choose()): a first start, not an error.
NOTHING_TO_RESTORE = "nothing to restore"

_term = False


def _on_term(signum: int, frame: Any) -> None:
    # Only note it: the ranks must stop at the same step (a collective), which a handler can't do.
    global _term
    _term = True


def log(rank: int, msg: str, **fields: Any) -> None:
    if rank == 0:
        extra = "".join(f" {k}={v}" for k, v in fields.items())
        print(f"tiered-train: {msg}{extra}", flush=True)


def tiered_ckpt_cli() -> list[str]:
    """The `tiered-ckpt` command: the installed console script, else this interpreter's module."""
    exe = shutil.which("tiered-ckpt")
    return [exe] if exe else [sys.executable, "-m", "tiered_ckpt"]


def restore_latest(cfg_path: str | None) -> str | None:
    """Rank 0: newest committed checkpoint on either tier, made readable on Lustre; None if none."""
    cmd = [*tiered_ckpt_cli(), "restore", "--latest", "--json"]
    if cfg_path:
        cmd += ["--config", cfg_path]
    p = subprocess.run(cmd, capture_output=True, text=True, check=False)
    try:
        out = json.loads(p.stdout) if p.stdout.strip() else {}
    except json.JSONDecodeError:
        out = {}
    if p.returncode == 0 and out.get("ok"):
        print(f"tiered-train: restore source={out['source']} name={out['name']} bytes={out['bytes']}", flush=True)
        return str(out["name"])
    err = str(out.get("error") or p.stderr.strip() or f"exit {p.returncode}")
    if p.returncode == EXIT_FAILED and NOTHING_TO_RESTORE in err:
        return None
    # Anything else (archive down with nothing local, a lock held too long): fail the job loudly
    # rather than start from scratch and overwrite progress.
    raise SystemExit(f"tiered-train: cannot resume: {err}")


def build_model(device: torch.device) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1)).to(device)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=1000, help="train until this step")
    ap.add_argument("--save-every", type=int, default=100, metavar="K", help="checkpoint every K steps")
    ap.add_argument("--step-sleep", type=float, default=0.0, help="seconds to idle per step (tests: a slow model)")
    ap.add_argument("--no-save-on-term", action="store_true", help="on SIGTERM only finish the save in flight")
    ap.add_argument("--memory-every", type=int, default=0, metavar="M",
                    help="also save to the memory tier every M steps (needs memory.dir in the node config; 0 = off)")
    args = ap.parse_args(argv)

    signal.signal(signal.SIGTERM, _on_term)
    cfg_path = os.environ.get(config_mod.ENV_VAR)
    cfg = config_mod.load(cfg_path)

    use_cuda = torch.cuda.is_available()
    if use_cuda:
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
        # cpu:gloo too: async_save needs a CPU backend (its own error says so).
        dist.init_process_group("cpu:gloo,cuda:nccl", timeout=timedelta(minutes=10))
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo", timeout=timedelta(minutes=10))
    rank, world = dist.get_rank(), dist.get_world_size()
    ckpt_pg = dist.new_group(backend="gloo")

    model = DistributedDataParallel(build_model(device), device_ids=[device.index] if use_cuda else None)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)

    use_memory = bool(args.memory_every and cfg.memory.dir)
    if args.memory_every and not cfg.memory.dir:
        log(rank, "memory tier off (no memory.dir in the node config)")

    # -- resume ---------------------------------------------------------------------------------
    start = 0
    from_memory = None
    if use_memory:
        def load_copy(root: Any, name: str) -> None:
            msd, osd = get_state_dict(model, optim)
            st: dict[str, Any] = {"model": msd, "optim": osd}
            reader = TieredReader(root, cfg.model, name=name, config=cfg.with_overrides(io={"direct": False}))
            dcp.load(st, storage_reader=reader, no_dist=True)
            set_state_dict(model, optim, model_state_dict=st["model"], optim_state_dict=st["optim"])

        from_memory = memory_tier.restore(cfg, load_copy)
    choice: list[str | None] = [None]
    if from_memory is not None:
        start = require_name(from_memory[0].name, cfg.naming).step
        log(rank, "resumed", step=start, name=from_memory[0].name, tier=from_memory[0].tier)
    else:
        choice = [restore_latest(cfg_path) if rank == 0 else None]
        dist.broadcast_object_list(choice, src=0, group=ckpt_pg)
    if choice[0] is not None:
        msd, osd = get_state_dict(model, optim)
        state: dict[str, Any] = {"model": msd, "optim": osd}
        dcp.load(state, storage_reader=TieredReader(config=cfg, name=choice[0]), process_group=ckpt_pg)
        set_state_dict(model, optim, model_state_dict=state["model"], optim_state_dict=state["optim"])
        start = require_name(choice[0], cfg.naming).step
        log(rank, "resumed", step=start, name=choice[0])
    elif from_memory is None:
        log(rank, "fresh start", step=0)
    log(rank, "started", world=world, device=device.type, restarts=os.environ.get("SLURM_RESTART_COUNT", "0"))

    # -- train ----------------------------------------------------------------------------------
    g = torch.Generator().manual_seed(1234 + rank)
    pending: Any = None          # the async save in flight
    pending_step = -1
    last_saved = start

    def save(step: int, asynchronous: bool) -> None:
        nonlocal pending, pending_step, last_saved
        wait_pending()
        msd, osd = get_state_dict(model, optim)
        writer = TieredWriter(config=cfg, epoch=0, step=step)
        if asynchronous:
            pending = dcp.async_save({"model": msd, "optim": osd}, storage_writer=writer, process_group=ckpt_pg,
                                     async_checkpointer_type=AsyncCheckpointerType.THREAD)
            pending_step = step
        else:
            dcp.save({"model": msd, "optim": osd}, storage_writer=writer, process_group=ckpt_pg)
            log(rank, "saved", step=step, name=writer.cid.name)
        last_saved = step

    def wait_pending() -> None:
        nonlocal pending
        if pending is not None:
            pending.result()      # raises if the save failed: never train on past a lost checkpoint
            log(rank, "saved", step=pending_step)
            pending = None

    step = start
    loss_value = float("nan")
    stop = torch.zeros(1, device=device)
    while step < args.steps:
        x = torch.randn(64, 16, generator=g).to(device)
        y = x.sum(dim=1, keepdim=True)
        loss = torch.nn.functional.mse_loss(model(x), y)
        optim.zero_grad()
        loss.backward()
        optim.step()
        loss_value = loss.item()
        step += 1
        if args.step_sleep:
            time.sleep(args.step_sleep)
        if step % args.save_every == 0:
            save(step, asynchronous=True)
        elif use_memory and step % args.memory_every == 0:
            msd, osd = get_state_dict(model, optim)
            memory_tier.save({"model": msd, "optim": osd}, cfg, make_id(0, step, cfg.naming), persist=False)
            log(rank, "saved to memory", step=step)
        # Every rank stops at the same step: whoever saw SIGTERM tells the others.
        stop.fill_(1.0 if _term else 0.0)
        # (the training group: the checkpoint group may be busy with the async save's collectives)
        dist.all_reduce(stop, op=dist.ReduceOp.MAX)
        if stop.item() > 0:
            log(rank, "SIGTERM", step=step)
            wait_pending()
            if not args.no_save_on_term and step > last_saved:
                save(step, asynchronous=False)
            log(rank, "stopped", step=step)
            dist.destroy_process_group()
            return 0
    wait_pending()
    if step > last_saved:
        save(step, asynchronous=False)
    log(rank, "done", step=step, loss=f"{loss_value:.4f}")
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
