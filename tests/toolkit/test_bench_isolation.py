"""`bench` into a root that holds a model's real checkpoints changes nothing any lifecycle command sees."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import yaml

from tiered_ckpt import api


def _cli(conf: Path, *argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "tiered_ckpt", *argv, "--config", str(conf)],
                          capture_output=True, text=True, timeout=120, env=os.environ.copy())


def test_bench_never_plants_a_checkpoint_beside_training(tmp_path: Path, azurite_container: tuple[str, str]) -> None:
    conn, container = azurite_container
    root = tmp_path / "checkpoints"
    root.mkdir()
    conf = tmp_path / "config.yaml"
    conf.write_text(yaml.safe_dump({
        "root": str(root), "model": "llama", "backend": "local",
        "io": {"threads": 2, "files_per_rank": 2, "block_size": "1MiB", "sync_buffer_bytes": "4MiB"},
        "archive": {"connection_string": conn, "container": container, "retries": 1},
        "retention": {"keep_last": 1, "min_keep": 1},
    }))
    for step in (100, 200):
        api.save({"w": np.full(1 << 16, step % 251, dtype=np.uint8)}, epoch=0, step=step, root=root, model="llama",
                 config=_cfg(conf))

    def observe() -> tuple[str | None, list[str], list[dict[str, str]]]:
        latest = api.latest(root=root, model="llama", config=_cfg(conf))
        listed = json.loads(_cli(conf, "list", "--json").stdout)["checkpoints"]
        plan = json.loads(_cli(conf, "retention", "plan", "--json").stdout)
        return (latest.name if latest else None, [r["name"] for r in listed],
                [{"name": d["name"], "decision": d["decision"]} for d in plan["checkpoints"]])

    before = observe()
    assert before[0] == "global_epoch0_step200"

    p = _cli(conf, "bench", "--dir", str(root), "--size", "2MiB", "--keep", "--json")
    assert p.returncode == 0, p.stderr
    kept = Path(json.loads(p.stdout)["path"])
    assert (kept / "COMMITTED.json").exists()
    assert root / "llama" not in kept.parents and kept.is_relative_to(root / ".tiered-ckpt-bench")
    p = _cli(conf, "bench", "--dir", str(root), "--size", "1MiB", "--buffered")       # without --keep
    assert p.returncode == 0, p.stderr
    assert "deleted" in p.stdout
    assert [d.name for d in (root / ".tiered-ckpt-bench").iterdir()] == [kept.parent.name]   # only the --keep run
    p = _cli(conf, "bench", "--dir", str(root), "--size", "1MiB", "--keep")
    assert p.returncode == 0 and "kept at" in " ".join(p.stdout.split()) and ".tiered-ckpt-bench" in p.stdout

    assert observe() == before
    assert sorted(n for n in os.listdir(root / "llama") if not n.startswith(".")) == ["global_epoch0_step100",
                                                                                      "global_epoch0_step200"]
    st = tmp_path / "export-status.json"
    p = _cli(conf, "export", "--once", "--json", "--export-status", str(st))
    assert p.returncode == 0, p.stderr
    from azure.storage.blob import ContainerClient

    names = [b.name for b in ContainerClient.from_connection_string(conn, container).list_blobs()]
    assert names and not [n for n in names if "bench" in n or "llama/" not in n]
    p = _cli(conf, "restore", "--latest", "--json")
    assert p.returncode == 0, p.stderr
    assert json.loads(p.stdout)["name"] == "global_epoch0_step200"


def _cfg(conf: Path):  # noqa: ANN202
    from tiered_ckpt import config

    return config.load(str(conf))
