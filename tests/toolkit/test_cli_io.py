"""`tiered-ckpt bench | list | verify` through the real CLI entry point."""
from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tiered_ckpt.cli import app as cli
from tiered_ckpt.io import commit


@pytest.fixture
def conf(tmp_path: Path, root: Path) -> Path:
    p = tmp_path / "config.yaml"
    p.write_text(yaml.safe_dump({
        "root": str(root), "model": "m", "backend": "local", "nodes": 4,
        "io": {"threads": 2, "files_per_rank": 2, "block_size": "1MiB", "sync_buffer_bytes": "4MiB"},
        "amlfs": {"provisioned_gbps": 8.0},
    }))
    return p


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    rc = cli.main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def test_bench_json_reports_rates_and_share_of_provisioned_bandwidth(capsys: pytest.CaptureFixture[str], conf: Path, root: Path) -> None:
    rc, out, _ = run(capsys, "bench", "--config", str(conf), "--dir", str(root), "--size", "6MiB", "--files", "3",
                     "--threads", "2", "--block", "512KiB", "--json")
    d = json.loads(out)
    assert rc == 0
    for k in ("bytes", "files", "threads", "write_seconds", "write_GBps", "read_seconds", "read_GBps"):
        assert k in d
    assert d["bytes"] == 6 << 20 and d["files"] == 3 and d["threads"] == 2 and d["direct"] and d["hash"]
    assert d["write_GBps"] == pytest.approx(d["bytes"] / d["write_seconds"] / 1e9, rel=0.01)
    assert d["node_share_GBps"] == 2.0 and d["write_share_of_node_share"] == pytest.approx(d["write_GBps"] / 2.0, rel=0.01)
    assert not d["kept"] and commit.scan(root, "m") == [], "without --keep the benchmark checkpoint is removed"


def _into_model(out: str, model_dir: Path) -> None:
    """Move a checkpoint bench kept (in its scratch directory) into the model's directory."""
    kept = Path(json.loads(out)["path"])
    model_dir.mkdir(exist_ok=True)
    kept.rename(model_dir / kept.name)


def test_bench_keep_then_list_and_verify(capsys: pytest.CaptureFixture[str], conf: Path, root: Path) -> None:
    c = ("--config", str(conf))
    rc, out, _ = run(capsys, "bench", *c, "--size", "3MiB", "--keep", "--buffered", "--json")
    assert rc == 0
    _into_model(out, root / "m")
    rc, out, _ = run(capsys, "bench", *c, "--size", "2MiB", "--keep", "--name", "global_epoch5_step50", "--json")
    assert rc == 0 and json.loads(out)["name"] == "global_epoch5_step50"
    _into_model(out, root / "m")
    (root / "m" / "global_epoch6_step1").mkdir()                 # a save in progress
    rc, out, _ = run(capsys, "list", *c, "--json")
    rows = {r["name"]: r for r in json.loads(out)["checkpoints"]}
    assert rc == 0 and list(rows) == ["global_epoch0_step1", "global_epoch5_step50", "global_epoch6_step1"]
    assert rows["global_epoch0_step1"]["committed"] and rows["global_epoch0_step1"]["bytes"] >= 3 << 20
    assert rows["global_epoch5_step50"]["latest"] and not rows["global_epoch6_step1"]["committed"]
    rc, out, _ = run(capsys, "list", *c)
    assert rc == 0 and re.search(r"global_epoch6_step1\s*│\s*6\s*│\s*1\s*│\s*NO\b", out)
    assert "latest committed: global_epoch5_step50" in out

    assert run(capsys, "verify", *c, "global_epoch5_step50", "--hash")[0] == 0
    shard = sorted((root / "m" / "global_epoch5_step50").glob("shard-*.bin"))[0]
    data = bytearray(shard.read_bytes())
    data[5] ^= 1
    shard.write_bytes(bytes(data))
    assert run(capsys, "verify", *c, "global_epoch5_step50")[0] == 0           # sizes still match
    rc, out, _ = run(capsys, "verify", *c, "global_epoch5_step50", "--hash", "--json")
    assert rc == 1 and not json.loads(out)["ok"] and "hash differs" in json.loads(out)["problems"][0]
    rc, _, err = run(capsys, "verify", *c, "global_epoch6_step1")
    assert rc == 1 and "not committed" in err
    rc, _, err = run(capsys, "verify", *c, "global_epoch9_step9")
    assert rc == 1 and "does not exist" in err


def test_bench_keep_runs_never_collide(capsys: pytest.CaptureFixture[str], conf: Path, root: Path) -> None:
    # Each run has its own scratch directory: a kept name never meets another run's or a model's.
    c = ("--config", str(conf))
    rc, out1, _ = run(capsys, "bench", *c, "--size", "1MiB", "--keep", "--name", "global_epoch1_step1", "--json")
    assert rc == 0
    rc, out2, _ = run(capsys, "bench", *c, "--size", "1MiB", "--keep", "--name", "global_epoch1_step1", "--json")
    assert rc == 0 and json.loads(out1)["path"] != json.loads(out2)["path"]
    assert commit.scan(root, "m") == []


@pytest.mark.parametrize("argv, needle", [
    (["bench", "--size", "1MiB", "--dir", "/nonexistent/ckpt"], "/nonexistent/ckpt does not exist"),
    (["bench", "--size", "1MiB", "--name", "global_epoch0_step1"], "--name only applies with --keep"),
    (["bench", "--size", "lots"], "--size: 'lots' is not a size"),
    (["bench", "--size", "1MiB", "--block", "1000"], "multiple of 4 KiB"),
    (["verify", "latest"], "not of the form global_epoch"),
])
def test_user_errors_are_one_line_without_traceback(conf: Path, argv: list[str], needle: str) -> None:
    p = subprocess.run([sys.executable, "-m", "tiered_ckpt", *argv, "--config", str(conf)], capture_output=True, text=True, timeout=60)
    assert p.returncode == 2, p.stderr
    assert needle in " ".join(p.stderr.split()) and "Traceback" not in p.stderr
