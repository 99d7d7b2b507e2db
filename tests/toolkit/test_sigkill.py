"""SIGKILL a writing process at many random moments: no directory may look committed unless it is
complete and intact, and checkpoints committed earlier must survive."""
from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

from tiered_ckpt.io import commit
from tiered_ckpt.io.marker import MARKER
from tiered_ckpt.io.reader import verify

WRITER = r"""
import os, sys
import tiered_ckpt as tc
from tiered_ckpt.io import commit
from tiered_ckpt.io.marker import MARKER
from tiered_ckpt.config import IoConfig, NodeConfig
cfg = NodeConfig(root=sys.argv[1], model="m", io=IoConfig(threads=3, files_per_rank=4, block_size=128 << 10,
                                                           sync_buffer_bytes=512 << 10, staging_bytes=1 << 20))
run = int(sys.argv[2])
while True:
    last = tc.latest(config=cfg)
    step = last.id.step + 1 if last else 1
    state = {"w": os.urandom((1 << 20) + 4096 * (step % 7) + 13), "meta": f"step {step}".encode()}
    if step % 2:
        tc.save(state, epoch=0, step=step, config=cfg)                 # over a crashed attempt, if any
    else:
        tc.async_save(state, epoch=0, step=step, config=cfg).wait()
    print("C", commit.CheckpointId(0, step).name, flush=True)
    done = [c for c in commit.scan(cfg.root, "m") if c.committed]
    for c in done[:-3]:                                                # keep the newest three
        print("D", c.name, flush=True)
        commit.remove_checkpoint(c.path)
"""


def test_sigkill_at_random_points_never_leaves_a_false_commit(root: Path) -> None:
    seed = int(os.environ.get("SIGKILL_SEED", time.time()))
    rnd = random.Random(seed)
    reported: list[str] = []
    deleted: set[str] = set()
    kills = mid_save = 0
    for run in range(25):
        p = subprocess.Popen([sys.executable, "-c", WRITER, str(root), str(run)], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
        assert p.stdout is not None
        first = p.stdout.readline()                 # its first commit: start-up is over, saves are looping
        assert first, f"writer failed to start (seed {seed}): {p.communicate(timeout=30)[1][-2000:]}"
        time.sleep(rnd.uniform(0.0, 0.5))
        p.send_signal(signal.SIGKILL)
        p.wait(timeout=30)
        # read through the same buffered file object readline() used (communicate() would skip its buffer)
        out, err = first + p.stdout.read(), p.stderr.read() if p.stderr else ""
        p.stdout.close()
        if p.stderr:
            p.stderr.close()
        assert p.returncode == -signal.SIGKILL, f"writer died on its own (seed {seed}): {err[-2000:]}"
        kills += 1
        # Only whole lines count: the kill may cut the last one, and nothing it announced has
        # happened yet ("C" is printed after the commit returns, "D" before the delete starts).
        for line in out.split("\n")[:-1]:
            tag, name = line.split()
            (reported.append if tag == "C" else deleted.add)(name)

        infos = commit.scan(root, "m")
        mid_save += any(not c.committed for c in infos)
        for c in infos:
            if (c.path / MARKER).exists() and commit.read_marker(c.path) is not None:
                rep = verify(c.path, check_hash=True)
                assert rep.ok, f"{c.name} has a marker but is not intact (seed {seed}, run {run}): {rep.problems}"
        alive = [n for n in reported if n not in deleted]
        for name in alive:
            info = commit.find(root, "m", name)
            assert info is not None and info.committed, f"{name} was committed, then lost (seed {seed}, run {run})"
        latest = commit.latest_committed(root, "m")
        if reported:
            assert latest is not None and latest.id >= commit.CheckpointId(0, int(reported[-1].rsplit("step", 1)[1]))
    assert kills == 25 and len(reported) >= 25
    # most kills land inside a save (writing, fsync, commit or delete), leaving an unfinished directory
    assert mid_save >= 5, f"only {mid_save} of 25 kills hit a save in progress (seed {seed})"
    print(f"seed {seed}: {len(reported)} saves, {mid_save} kills mid-save")
