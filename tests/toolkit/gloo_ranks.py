"""Real gloo ranks as subprocesses for the DCP tests: every rank of one run starts at once
(rendezvous through a file:// store), each prints one JSON line as its last stdout line."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# The start of every rank script: its arguments (one JSON object), the process group, report().
PRELUDE = r"""
import json, os, sys, time
from datetime import timedelta
import torch
import torch.distributed as dist
A = json.loads(sys.argv[1])
rank, world, root = A["rank"], A["world"], A["root"]
dist.init_process_group("gloo", init_method="file://" + A["store"], rank=rank, world_size=world,
                        timeout=timedelta(seconds=A.get("pg_timeout", 120)))

def report(**kw):
    print(json.dumps(kw), flush=True)

def leave(agree=True):
    # gloo's teardown at interpreter exit sometimes aborts ("terminate called without an active
    # exception"): agree that every rank is done, then leave without it
    if agree:
        dist.barrier()
    sys.stdout.flush(); sys.stderr.flush()
    os._exit(0)
"""


@dataclass
class Ranked:
    rank: int
    rc: int | None
    out: dict[str, Any]
    err: str
    seconds: float     # from the start of the run to this rank's exit


def start(body: str, world: int, store: Path, **args: Any) -> tuple[float, list[subprocess.Popen[str]]]:
    """Start all `world` ranks of one run of PRELUDE + body; `args` reach the script as A[...]."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    t0 = time.monotonic()
    procs = [subprocess.Popen([sys.executable, "-c", PRELUDE + body,
                               json.dumps(dict(args, rank=r, world=world, store=str(store)))],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
             for r in range(world)]
    return t0, procs


def collect(t0: float, procs: list[subprocess.Popen[str]], timeout: float = 240) -> list[Ranked]:
    """Wait for every rank (bounded: a rank still running after `timeout` s is killed, rc None)."""
    done: list[Ranked] = []
    for r, p in enumerate(procs):
        try:
            out, err = p.communicate(timeout=max(1.0, timeout - (time.monotonic() - t0)))
            rc: int | None = p.returncode
        except subprocess.TimeoutExpired:
            p.kill()
            out, err = p.communicate()
            rc = None
        lines = [ln for ln in out.strip().splitlines() if ln.startswith("{")]
        done.append(Ranked(r, rc, json.loads(lines[-1]) if lines else {}, err, time.monotonic() - t0))
    return done


def run(body: str, world: int, store: Path, timeout: float = 240, **args: Any) -> list[Ranked]:
    """Run every rank to its end; each must exit 0."""
    res = collect(*start(body, world, store, **args), timeout=timeout)
    for r in res:
        assert r.rc == 0, f"rank {r.rank} exited {r.rc}: {r.err[-4000:]}"
    return res
