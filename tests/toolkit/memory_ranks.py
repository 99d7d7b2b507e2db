"""Simulated nodes for the memory-tier tests: each node is its own launch of real gloo ranks on
127.0.0.1 (torchrun's env: LOCAL_WORLD_SIZE, GROUP_RANK, LOCAL_RANK) with its own memory directory;
every rank runs a list of actions and prints one JSON line as its last stdout line."""
from __future__ import annotations

import hashlib
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from tests.toolkit import gloo_ranks
from tests.toolkit.gloo_ranks import Ranked

BODY = r"""
import hashlib, json, os, signal, sys, time
from datetime import timedelta
import torch
import torch.distributed as dist
A = json.loads(sys.argv[1])
rank, world = A["rank"], A["world"]
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{A['port']}", rank=rank, world_size=world,
                        timeout=timedelta(seconds=A.get("pg_timeout", 120)))
from tiered_ckpt import config as C, memory_tier
from tiered_ckpt.training import load_training, save_training
mem = C.MemoryConfig(dir=A["mem"], keep=A.get("keep", 2), persist_every=A.get("persist_every", 100),
                     timeout=A.get("timeout", 30), budget_bytes=A.get("budget", 0),
                     notice_file=A.get("notice", "/nonexistent/notice"), peer_distance=A.get("distance", 1))
cfg = C.NodeConfig(root=A["root"], model="m", memory=mem)

def model_at(step, width=None):
    torch.manual_seed(step)
    return torch.nn.Sequential(torch.nn.Linear(width or A.get("width", 32), 32), torch.nn.Linear(32, 4))

def digest(m):
    return hashlib.sha256(b"".join(p.detach().numpy().tobytes() for p in m.state_dict().values())).hexdigest()

kill = A.get("kill")            # [rank, step, "save" | "replica"]: SIGKILL there
if kill and kill[0] == rank:
    if kill[2] == "save":
        import tiered_ckpt.dcp as D
        real = D.commit.write_marker
        def dying(path, m, **kw):
            if m.step == kill[1]:
                os.kill(os.getpid(), signal.SIGKILL)
            return real(path, m, **kw)
        D.commit.write_marker = dying
    else:
        import tiered_ckpt.replica as R
        real_send = R._send_bytes
        sent = [0]
        def dying_send(data, dst, g):
            if memory_tier._state["saves"] == kill[1]:
                sent[0] += 1
                if sent[0] == 3:            # the header, one chunk: then gone
                    os.kill(os.getpid(), signal.SIGKILL)
            return real_send(data, dst, g)
        R._send_bytes = dying_send

out = {"saved": [], "errors": []}
for act in A["actions"]:
    if act[0] == "save":
        m = model_at(act[1], act[4] if len(act) > 4 else None)
        try:
            save_training(m, epoch=0, step=act[1], config=cfg, tier=act[2] if len(act) > 2 else "memory",
                          extra={"rank": rank, "step": act[1]}, persist=act[3] if len(act) > 3 else None)
            out["saved"].append(act[1])
        except Exception as e:
            out["errors"].append(f"{type(e).__name__}: {e}")
        err = memory_tier.wait_background()
        if err is not None:
            out["errors"].append(f"background: {err}")
    elif act[0] == "load":
        m = model_at(999)
        try:
            st = load_training(m, config=cfg)
            out.update(step=st.step, tier=st.tier, extra=st.extra, digest=digest(m),
                       expected=digest(model_at(st.step)))
        except Exception as e:
            out["errors"].append(f"{type(e).__name__}: {e}")
    elif act[0] == "touch":
        open(act[1], "w").close()
    elif act[0] == "flush_on_term":
        memory_tier.install_emergency_flush(cfg)
        print(json.dumps({"ready": True}), flush=True)
        time.sleep(60)
out["stats"] = dict(memory_tier.stats)
print(json.dumps(out), flush=True)
sys.stdout.flush(); sys.stderr.flush()
os._exit(0)
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start(nodes: int, per_node: int, root: Path, mems: list[Path], actions: list[list[Any]],
          **args: Any) -> tuple[float, list[subprocess.Popen[str]]]:
    """Every node's ranks, each node its own launch with torchrun's env and its memory dir."""
    port = free_port()
    world = nodes * per_node
    t0 = time.monotonic()
    procs = []
    for node in range(nodes):
        for lr in range(per_node):
            rank = node * per_node + lr
            env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path), LOCAL_WORLD_SIZE=str(per_node),
                       GROUP_RANK=str(node), LOCAL_RANK=str(lr), RANK=str(rank), WORLD_SIZE=str(world))
            a = dict(args, rank=rank, world=world, port=port, root=str(root), mem=str(mems[node]), actions=actions)
            procs.append(subprocess.Popen([sys.executable, "-c", BODY, json.dumps(a)], stdout=subprocess.PIPE,
                                          stderr=subprocess.PIPE, text=True, env=env))
    return t0, procs


def collect(t0: float, procs: list[subprocess.Popen[str]], timeout: float = 600) -> list[Ranked]:
    """gloo_ranks.collect, with the longer bound a multi-node memory run needs."""
    return gloo_ranks.collect(t0, procs, timeout)


def run(nodes: int, per_node: int, root: Path, mems: list[Path], actions: list[list[Any]],
        **args: Any) -> list[Ranked]:
    return collect(*start(nodes, per_node, root, mems, actions, **args))


def expected_digest(step: int, width: int = 32) -> str:
    import torch

    torch.manual_seed(step)
    m = torch.nn.Sequential(torch.nn.Linear(width, 32), torch.nn.Linear(32, 4))
    return hashlib.sha256(b"".join(p.detach().numpy().tobytes() for p in m.state_dict().values())).hexdigest()
