"""`tiered-ckpt metrics`: Prometheus samples after a real local lifecycle (saves through the API, the
local exporter into Azurite, retention, a restore from the archive), parsed with prometheus-client's
own parser, as a textfile and scraped over HTTP from `--serve`."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

import tiered_ckpt as tc
from tests.lifecycle.helpers import REPO, local_cfg
from tiered_ckpt.cli import app as cli
from tiered_ckpt.config import ArchiveConfig, dump
from tiered_ckpt.lifecycle import retention as ret
from tiered_ckpt.lifecycle.exporter import Exporter
from tiered_ckpt.lifecycle.restore import restore
from tiered_ckpt.lifecycle.status import gather
from tiered_ckpt.tiers.backends import LocalBackend
from tiered_ckpt.tiers.blob import BlobStore

N = 3 << 20


def parse(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, tuple(sorted((k, v) for k, v in s.labels.items() if k != "model")))] = s.value
    return out


def value(m: dict, name: str, **labels: str) -> float | None:
    return m.get(("tiered_ckpt_" + name, tuple(sorted(labels.items()))))


@pytest.fixture
def lifecycle(tmp_path: Path, azurite_container: tuple[str, str]):
    conn, container = azurite_container
    root = tmp_path / "lustre"
    root.mkdir()
    cfg = local_cfg(root, conn, container, keep_last=1, min_keep=1, restore_grace=0)
    store = BlobStore(cfg.archive, backoff=0.01)
    for step in (10, 20, 30):
        tc.save({"w": os.urandom(N)}, epoch=0, step=step, config=cfg)
    tc.async_save({"w": os.urandom(N)}, epoch=0, step=40, config=cfg).wait(60)
    Exporter(cfg, store).iterate()          # its status file where `status` and `metrics` look
    backend = LocalBackend(cfg, store)
    res = ret.apply(cfg, backend, ret.Policy.from_config(cfg.retention))
    assert len(res.done) == 3
    restore(cfg, backend, "global_epoch0_step10")
    conf = tmp_path / "node.yaml"
    conf.write_text(dump(cfg))
    return cfg, conf, tmp_path


def test_textfile_after_a_real_lifecycle(lifecycle, capsys) -> None:
    cfg, conf, tmp = lifecycle
    prom = tmp / "tiered_ckpt.prom"
    assert cli.main(["metrics", "--config", str(conf), "--textfile", str(prom)]) == 0
    m = parse(prom.read_text())
    assert value(m, "newest_committed_step") == 40
    assert value(m, "newest_archived_step") == 40
    assert value(m, "archive_lag_seconds") == 0
    st = gather(LocalBackend(cfg, BlobStore(cfg.archive, backoff=0.01)))
    assert value(m, "export_backlog_files") == st.backlog.files and value(m, "export_backlog_bytes") == st.backlog.bytes
    assert value(m, "export_failed_files") == 0
    assert value(m, "retention_deleted_total") == 3 and value(m, "retention_blocked") == 0
    assert N <= value(m, "restore_bytes", path="download") < N + 65536 and value(m, "restore_seconds", path="download") > 0
    assert N <= value(m, "save_bytes") < N + 65536 and value(m, "save_seconds") > 0
    assert value(m, "save_throughput_bytes_per_second") == pytest.approx(N / value(m, "save_seconds"))
    assert 0 <= value(m, "async_blocked_seconds") < 60
    assert value(m, "accelerator_free_bytes") > 0
    assert value(m, "check_ok", part="archive") == 1 and value(m, "check_ok", part="tiers") == 1
    # the records are outside the exported tree: the archive holds checkpoints only
    assert not any(".records" in p.name for p in (Path(cfg.root) / "m").iterdir())


def test_an_unreachable_archive_is_reported_not_shown_as_zero(lifecycle, tmp_path: Path) -> None:
    cfg, _, _ = lifecycle
    dead = cfg.with_overrides(archive=ArchiveConfig(
        connection_string="DefaultEndpointsProtocol=http;AccountName=devstoreaccount1;AccountKey=a2V5;"
                          "BlobEndpoint=http://127.0.0.1:9/devstoreaccount1", container="c", retries=0, timeout=2))
    conf = tmp_path / "dead.yaml"
    conf.write_text(dump(dead))
    out = subprocess.run([sys.executable, "-m", "tiered_ckpt.cli.app", "metrics", "--config", str(conf)], cwd=REPO,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    m = parse(out.stdout)
    assert value(m, "check_ok", part="archive") == 0
    assert value(m, "newest_archived_step") is None          # unknown, not 0
    assert value(m, "newest_committed_step") == 40


@pytest.mark.timeout(120)
def test_serve_is_scraped_with_fresh_values(lifecycle) -> None:
    cfg, conf, _ = lifecycle
    proc = subprocess.Popen([sys.executable, "-m", "tiered_ckpt.cli.app", "metrics", "--config", str(conf), "--serve",
                             "--port", "0", "--json"], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        text = ""
        while True:                                  # --json prints one (indented) object
            text += proc.stdout.readline()
            try:
                url = json.loads(text)["serving"]
                break
            except ValueError:
                assert proc.poll() is None, proc.stderr.read() if proc.stderr else ""
        m = parse(urllib.request.urlopen(url, timeout=30).read().decode())
        assert value(m, "newest_committed_step") == 40
        tc.save({"w": os.urandom(1000)}, epoch=0, step=50, config=cfg)
        deadline = time.monotonic() + 30
        while value(m, "newest_committed_step") != 50 and time.monotonic() < deadline:
            m = parse(urllib.request.urlopen(url, timeout=30).read().decode())
        assert value(m, "newest_committed_step") == 50 and 1000 <= value(m, "save_bytes") < 65536
        assert value(m, "newest_archived_step") == 40          # not exported yet
    finally:
        proc.terminate()
        proc.wait(30)


def test_bad_metrics_settings_are_named(tmp_path: Path, capsys) -> None:
    conf = tmp_path / "c.yaml"
    conf.write_text(f"root: {tmp_path}\nmodel: m\nbackend: local\nmetrics:\n  port: 70000\n  textfile: /tmp/x.txt\n")
    assert cli.main(["metrics", "--config", str(conf)]) != 0
    err = capsys.readouterr().err
    assert "metrics.port: 70000" in err and "metrics.textfile" in err and ".prom" in err


def _serve(conf: Path) -> tuple[subprocess.Popen[str], str]:
    proc = subprocess.Popen([sys.executable, "-m", "tiered_ckpt.cli.app", "metrics", "--config", str(conf), "--serve",
                             "--port", "0", "--json"], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    text = ""
    while True:                                  # --json prints one (indented) object
        line = proc.stdout.readline()
        assert line or proc.poll() is None, proc.stderr.read() if proc.stderr else ""
        text += line
        try:
            return proc, json.loads(text)["serving"]
        except ValueError:
            pass


@pytest.mark.timeout(120)
def test_malformed_records_are_counted_and_concurrent_scrapes_share_one_collection(tmp_path: Path) -> None:
    """A hand-edited or planted record never fails a scrape; 24 scrapers at once all get 200 and
    cost the server one collection of the tiers (a few at most), not 24."""
    from concurrent.futures import ThreadPoolExecutor

    from tiered_ckpt import records
    root = tmp_path / "lustre"
    root.mkdir()
    tc.save({"w": os.urandom(1000)}, root=root, model="m", epoch=0, step=1)
    d = records.records_dir(root, "m")
    (d / "save.json").write_text('{"seconds": "fast", "bytes": 1000, "time_unix": 1}')   # not a number
    (d / "retention.json").write_text("[1, 2]")                                          # not a record
    (d / "restore.json").write_text('{"by_path": {"download": {"seconds": 2, "bytes": 7}}, "time_unix": 1}')
    conf = tmp_path / "c.yaml"
    conf.write_text(f"root: {root}\nmodel: m\nbackend: local\n")
    proc, url = _serve(conf)
    try:
        def scrape(_: int) -> tuple[int, str]:
            with urllib.request.urlopen(url, timeout=60) as r:
                return r.status, r.read().decode()
        with ThreadPoolExecutor(24) as pool:
            got = list(pool.map(scrape, range(24)))
        assert [s for s, _ in got] == [200] * 24
        for _, text in got:
            m = parse(text)
            assert value(m, "malformed_records", kind="save") == 1
            assert value(m, "malformed_records", kind="retention") == 1
            assert value(m, "malformed_records", kind="restore") == 0
            assert value(m, "save_seconds") is None and value(m, "save_bytes") is None    # left out whole
            assert value(m, "restore_bytes", path="download") == 7                       # the good one stays
            assert value(m, "newest_committed_step") == 1
        assert max(value(parse(t), "collections_total") or 0 for _, t in got) <= 3
    finally:
        proc.terminate()
        proc.wait(30)
