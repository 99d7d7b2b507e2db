"""`python -m tiered_demo.timeline --out docs/timeline.png` (`make timeline-png`): the README's picture.

The demo's lifecycle, run with the toolkit's own commands against a private Azurite, then drawn by
`tiered-ckpt timeline --out`: what a user sees on any root, not a picture made by the demo. A
training loop saves through the API (as training does); after each save the local exporter runs
once (`tiered-ckpt export --once`, the stand-in for AMLFS auto-export) and retention applies the
policy (`tiered-ckpt retention apply`). The exporter is held back for the last rounds, as during an
export outage, so retention blocks a checkpoint that is not proven archived; then it catches up,
retention frees that one, an old checkpoint is restored from the archive (the download path) and
the newest is restored in place (resident).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tiered_ckpt import api
from tiered_ckpt.config import ArchiveConfig, NodeConfig, RetentionConfig, dump, parse_duration, parse_size
from tiered_ckpt.errors import UserError
from tiered_ckpt.tiers.blob import BlobStore
from tiered_demo.azurite import Azurite

OUTAGE_ROUNDS = 3        # the last rounds run without the exporter


def toolkit(conf: Path, *args: str) -> dict[str, Any]:
    """One `tiered-ckpt ... --json` command; its JSON answer (a failure stops the run, with its message)."""
    r = subprocess.run([sys.executable, "-m", "tiered_ckpt", *args, "--config", str(conf), "--json"],
                       capture_output=True, text=True, timeout=300)
    if r.returncode != 0:
        raise UserError(f"tiered-ckpt {' '.join(args)} failed ({r.returncode}): {r.stderr.strip()[-500:]}")
    out: dict[str, Any] = json.loads(r.stdout) if r.stdout.strip() else {}
    return out


def run(out: Path, workdir: Path, checkpoints: int, size: int, interval: float, say: Any = print) -> dict[str, Any]:
    if checkpoints < OUTAGE_ROUNDS + 3:
        raise UserError(f"--checkpoints {checkpoints}: use at least {OUTAGE_ROUNDS + 3} (deletes, a block and restores)")
    work = workdir.resolve()
    for p in (work / "lustre", work / "azurite"):
        shutil.rmtree(p, ignore_errors=True)
    (work / "azurite").mkdir(parents=True)
    root = work / "lustre" / "checkpoints"
    root.mkdir(parents=True)
    with Azurite(location=str(work / "azurite")) as server:
        cfg = NodeConfig(root=str(root), model="demo-llm", backend="local",
                         archive=ArchiveConfig(container="checkpoints", prefix="checkpoints",
                                               connection_string=server.connection_string, concurrency=4, retries=3),
                         retention=RetentionConfig(keep_last=2, min_keep=2, action="delete"))
        conf = work / "node.yaml"
        conf.write_text(dump(cfg))
        BlobStore(cfg.archive).ensure_container()
        names = []
        for i in range(checkpoints):
            tick = time.monotonic()
            res = api.save({"model.weight": os.urandom(size)}, epoch=0, step=(i + 1) * 100, config=cfg)
            names.append(res.name)
            outage = i >= checkpoints - OUTAGE_ROUNDS
            if not outage:
                toolkit(conf, "export", "--once")
            done = toolkit(conf, "retention", "apply").get("applied") or []
            say(f"saved {res.name}; export {'held back' if outage else 'ran'}; retention: {', '.join(done) or 'nothing'}")
            time.sleep(max(0.0, interval - (time.monotonic() - tick)))
        toolkit(conf, "export", "--once")
        done = toolkit(conf, "retention", "apply").get("applied") or []
        say(f"export caught up; retention: {', '.join(done) or 'nothing'}")
        old = toolkit(conf, "restore", names[1])
        new = toolkit(conf, "restore", "--latest")
        say(f"restored {old['name']} ({old['source']}) and {new['name']} ({new['source']})")
        out = out.resolve()
        got = toolkit(conf, "timeline", "--out", str(out))
        say(f"timeline: {got['png']} ({len(got['events'])} events)")
        return got


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tiered_demo.timeline", description=__doc__.splitlines()[0])
    p.add_argument("--out", default="docs/timeline.png", help="the PNG to write (default: docs/timeline.png)")
    p.add_argument("--dir", default=".demo-timeline", help="work directory (default: .demo-timeline)")
    p.add_argument("--checkpoints", type=int, default=7, help="checkpoints to save (default: 7)")
    p.add_argument("--size", default="64MiB", help="bytes per checkpoint (default: 64MiB)")
    p.add_argument("--interval", default="2s", help="time between checkpoints (default: 2s)")
    a = p.parse_args(argv)
    try:
        run(Path(a.out), Path(a.dir), a.checkpoints, parse_size(a.size, "--size"),
            parse_duration(a.interval, "--interval"), say=lambda m: print(m, file=sys.stderr))
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return e.exit_code
    return 0


if __name__ == "__main__":
    sys.exit(main())
