"""Structured logs: one JSON object per stderr line with the operation's facts, for a real local
lifecycle (saves and a load through the API, the local exporter into Azurite, retention, a restore
from the archive) and for the command line (`--log-format json`: stdout keeps the `--json` result);
credentials never reach a log line; library modules never print; saves and the retention run
refresh the metrics textfile."""
from __future__ import annotations

import ast
import importlib.util
import json
import logging
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

import tiered_ckpt as tc
from tests.lifecycle.helpers import REPO, local_cfg, make_checkpoint
from tiered_ckpt import api, logs
from tiered_ckpt.config import ArchiveConfig, MetricsConfig, dump
from tiered_ckpt.errors import UserError
from tiered_ckpt.lifecycle import retention as ret
from tiered_ckpt.lifecycle.exporter import Exporter
from tiered_ckpt.lifecycle.restore import restore
from tiered_ckpt.tiers.backends import LocalBackend
from tiered_ckpt.tiers.blob import BlobStore

N = 1 << 20
SECRET = "c2VjcmV0LXNhcy1zaWduYXR1cmU"      # a SAS signature that must never be logged
HEAD = ("ts", "level", "logger", "message")


@pytest.fixture
def json_logs() -> Iterator[None]:
    logs.configure("json", "info")
    try:
        yield
    finally:
        root = logging.getLogger()
        for h in list(root.handlers):
            if isinstance(h, logs.RedactingHandler):
                root.removeHandler(h)
        logging.getLogger(logs.LOGGER).setLevel(logging.NOTSET)
        logs.configure("text", "warning")
        for h in list(root.handlers):
            if isinstance(h, logs.RedactingHandler):
                root.removeHandler(h)


def records(err: str) -> list[dict[str, Any]]:
    """Every stderr line parsed as one JSON object (a line that is not one fails the test)."""
    out = []
    for line in err.splitlines():
        rec = json.loads(line)
        assert isinstance(rec, dict) and all(k in rec for k in HEAD), line
        out.append(rec)
    return out


def of(recs: list[dict[str, Any]], operation: str) -> list[dict[str, Any]]:
    return [r for r in recs if r.get("operation") == operation]


@pytest.fixture
def env(tmp_path: Path, azurite_container: tuple[str, str]):
    conn, container = azurite_container
    root = tmp_path / "lustre"
    root.mkdir()
    cfg = local_cfg(root, conn, container, keep_last=1, min_keep=1, restore_grace=0)
    return cfg, BlobStore(cfg.archive, backoff=0.01)


def test_json_lines_carry_the_facts_of_save_load_export_retention_restore(env, json_logs, capsys, tmp_path) -> None:
    cfg, store = env
    for step in (10, 20, 30):
        tc.save({"w": os.urandom(N)}, epoch=0, step=step, config=cfg)
    got = tc.load(config=cfg)
    assert len(got["w"]) == N
    it = Exporter(cfg, store, status_path=tmp_path / "st.json").iterate()
    backend = LocalBackend(cfg, store)
    assert len(ret.apply(cfg, backend, ret.Policy.from_config(cfg.retention)).done) == 2
    restore(cfg, backend, "global_epoch0_step10")
    recs = records(capsys.readouterr().err)

    saves = of(recs, "save")
    assert [r["checkpoint"] for r in saves] == [f"global_epoch0_step{s}" for s in (10, 20, 30)]
    for r in saves:
        assert r["level"] == "INFO" and r["logger"] == "tiered_ckpt.api" and r["model"] == "m"
        assert r["outcome"] == "ok" and N <= r["bytes"] < N + 65536 and r["duration_s"] > 0
        assert r["checkpoint"] in r["message"]
        assert r["ts"].endswith("+00:00") and "T" in r["ts"]
    [load] = of(recs, "load")
    assert load["checkpoint"] == "global_epoch0_step30" and load["bytes"] == N and load["duration_s"] > 0
    [export] = of(recs, "export")
    assert export["outcome"] == "ok" and export["files_exported"] == it.files_exported > 3
    assert export["bytes"] == it.bytes_exported > 3 * N
    deleted = of(recs, "retention delete")
    assert sorted(r["checkpoint"] for r in deleted) == ["global_epoch0_step10", "global_epoch0_step20"]
    assert all(N <= r["bytes"] for r in deleted)
    [run] = of(recs, "retention")
    assert run["outcome"] == "ok" and run["freed"] == 2 and run["bytes"] == sum(r["bytes"] for r in deleted)
    [rest] = of(recs, "restore")
    assert rest["checkpoint"] == "global_epoch0_step10" and rest["path"] == "download"
    assert rest["bytes"] >= N and rest["duration_s"] > 0 and rest["outcome"] == "ok"


def test_a_failed_save_is_one_error_record(env, json_logs, capsys) -> None:
    cfg, _ = env
    tc.save({"w": b"x" * 100}, epoch=0, step=10, config=cfg)
    capsys.readouterr()
    with pytest.raises(UserError):
        tc.save({"w": b"x" * 100}, epoch=0, step=10, config=cfg)       # committed already: refused
    [r] = of(records(capsys.readouterr().err), "save")
    assert r["level"] == "ERROR" and r["outcome"] == "error" and r["checkpoint"] == "global_epoch0_step10"


def _cli(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "tiered_ckpt.cli.app", *argv], cwd=REPO, capture_output=True,
                          text=True, timeout=120, env={**os.environ, "PYTHONPATH": str(REPO / "src")})


def test_cli_json_logs_on_stderr_result_on_stdout(env, tmp_path: Path) -> None:
    cfg, store = env
    for s in (10, 20, 30):
        make_checkpoint(cfg.root, "m", 0, s)
    Exporter(cfg, store).iterate()
    conf = tmp_path / "c.yaml"
    conf.write_text(dump(cfg))
    p = _cli("retention", "apply", "--json", "--log-format", "json", "--config", str(conf))
    assert p.returncode == 0, p.stderr
    assert json.loads(p.stdout)["applied"] == ["delete global_epoch0_step10", "delete global_epoch0_step20"]
    recs = records(p.stderr)
    assert {r["checkpoint"] for r in of(recs, "retention delete")} == {"global_epoch0_step10", "global_epoch0_step20"}
    assert of(recs, "retention")[0]["freed"] == 2
    # Text (the default): a person at a terminal reads the command's output; INFO records stay out.
    p = _cli("retention", "apply", "--config", str(conf))
    assert p.returncode == 0 and p.stderr == "" and "done: nothing" in p.stdout


def test_credentials_never_reach_a_log_line(tmp_path: Path) -> None:
    root = tmp_path / "lustre"
    make_checkpoint(root, "m", 0, 10)
    # A SAS connection string to a closed port: every error quotes the service URL.
    cfg = local_cfg(root, "", "c").with_overrides(archive=ArchiveConfig(
        connection_string=f"BlobEndpoint=http://127.0.0.1:9/devstoreaccount1;"
                          f"SharedAccessSignature=sv=2024-08-04&ss=b&srt=sco&sp=rl&se=2030-01-01&sig={SECRET}",
        container="c", retries=0, timeout=2))
    conf = tmp_path / "c.yaml"
    conf.write_text(dump(cfg))
    for argv in (("status",), ("restore", "global_epoch0_step99"), ("export", "--once")):
        p = _cli(*argv, "--log-format", "json", "--log-level", "debug", "--config", str(conf))
        assert p.returncode != 0 and SECRET not in p.stdout + p.stderr, p.stderr
        recs = records(p.stderr)          # every stderr line is JSON: errors and warnings too
        assert recs, argv
    assert any(r["level"] == "ERROR" for r in recs) or any(r["level"] == "WARNING" for r in recs)


def test_library_modules_never_print() -> None:
    """Only the command line (tiered_ckpt/cli) writes to stdout/stderr; the rest logs (logs.py is the
    handler that writes records to stderr once the CLI or a script configures it)."""
    src = REPO / "src" / "tiered_ckpt"
    bad, seen = [], 0
    for path in sorted(src.rglob("*.py")):
        if "cli" in path.relative_to(src).parts or path == src / "logs.py":
            continue
        seen += 1
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "print":
                bad.append(f"{path.relative_to(REPO)}:{node.lineno}: print()")
            if isinstance(node, ast.Attribute) and node.attr in ("stdout", "stderr") \
                    and isinstance(node.value, ast.Name) and node.value.id == "sys":
                bad.append(f"{path.relative_to(REPO)}:{node.lineno}: sys.{node.attr}")
    assert seen > 30 and not bad, bad


def _textfile_samples(path: Path) -> dict[str, float]:
    return {s.name: s.value for fam in text_string_to_metric_families(path.read_text()) for s in fam.samples
            if not s.labels.get("part")}


def test_saves_and_the_retention_run_refresh_the_textfile(env, tmp_path: Path) -> None:
    cfg, store = env
    prom = tmp_path / "node-exporter" / "tiered_ckpt.prom"
    prom.parent.mkdir()
    cfg = cfg.with_overrides(metrics=MetricsConfig(textfile=str(prom)))
    tc.save({"w": os.urandom(N)}, epoch=0, step=10, config=cfg)
    api._flush_textfile()            # what interpreter exit does: wait for the background refresh
    m = _textfile_samples(prom)
    assert m["tiered_ckpt_newest_committed_step"] == 10 and N <= m["tiered_ckpt_save_bytes"] < N + 65536
    tc.save({"w": os.urandom(1000)}, epoch=0, step=20, config=cfg)
    api._flush_textfile()
    assert _textfile_samples(prom)["tiered_ckpt_newest_committed_step"] == 20
    Exporter(cfg, store).iterate()
    conf = tmp_path / "c.yaml"
    conf.write_text(dump(cfg))
    p = _cli("retention", "apply", "--json", "--config", str(conf))
    assert p.returncode == 0, p.stderr
    m = _textfile_samples(prom)
    assert m["tiered_ckpt_retention_deleted_total"] == 1 and m["tiered_ckpt_newest_archived_step"] == 20


@pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="torch not installed")
@pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")
@pytest.mark.timeout(180)
def test_dcp_commit_is_one_record(tmp_path: Path, json_logs, capsys) -> None:
    import torch
    import torch.distributed.checkpoint as dcp

    from tiered_ckpt.dcp import TieredWriter

    root = tmp_path / "lustre"
    root.mkdir()
    dcp.save({"w": torch.arange(4096, dtype=torch.float32)}, storage_writer=TieredWriter(str(root), "m", epoch=0, step=7))
    [r] = of(records(capsys.readouterr().err), "dcp save")
    assert r["checkpoint"] == "global_epoch0_step7" and r["model"] == "m" and r["outcome"] == "ok"
    assert r["bytes"] >= 4096 * 4 and r["duration_s"] > 0 and r["logger"] == "tiered_ckpt.dcp"
