"""`tiered-ckpt timeline` and `status --watch` after a real local lifecycle: saves through the API,
the local exporter into Azurite, retention (deletes and a block), a restore from the archive."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import tiered_ckpt as tc
from tests.lifecycle.helpers import REPO, local_cfg
from tiered_ckpt import records
from tiered_ckpt.cli import app as cli
from tiered_ckpt.config import dump
from tiered_ckpt.lifecycle import retention as ret
from tiered_ckpt.lifecycle import timeline
from tiered_ckpt.lifecycle.exporter import Exporter
from tiered_ckpt.lifecycle.restore import restore
from tiered_ckpt.tiers.backends import LocalBackend
from tiered_ckpt.tiers.blob import BlobStore

N = 2 << 20
S10, S20, S30, S40, S50 = (f"global_epoch0_step{s}" for s in (10, 20, 30, 40, 50))


@pytest.fixture
def lifecycle(tmp_path: Path, azurite_container: tuple[str, str]):
    conn, container = azurite_container
    root = tmp_path / "lustre"
    root.mkdir()
    cfg = local_cfg(root, conn, container, keep_last=1, min_keep=1, restore_grace=0)
    store = BlobStore(cfg.archive, backoff=0.01)
    for step in (10, 20, 30):
        tc.save({"w": os.urandom(N)}, epoch=0, step=step, config=cfg)
    Exporter(cfg, store).iterate()                   # 10, 20, 30 archived
    tc.save({"w": os.urandom(N)}, epoch=0, step=40, config=cfg)
    tc.async_save({"w": os.urandom(N)}, epoch=0, step=50, config=cfg).wait(60)
    backend = LocalBackend(cfg, store)
    policy = ret.Policy.from_config(cfg.retention)
    res = ret.apply(cfg, backend, policy)            # deletes 10, 20, 30; 40 blocked (not archived); 50 kept
    assert sorted(res.done) == [f"delete {n}" for n in (S10, S20, S30)]
    ret.apply(cfg, backend, policy)                  # the timer again: the same block, shown once
    restore(cfg, backend, S20)                       # back from the archive: the download path
    conf = tmp_path / "node.yaml"
    conf.write_text(dump(cfg))
    return cfg, backend, conf, tmp_path


def test_events_follow_the_lifecycle_in_order_with_durations(lifecycle) -> None:
    cfg, backend, _, _ = lifecycle
    tl = timeline.gather(backend)
    ev = tl.events
    assert [e.start_unix for e in ev] == sorted(e.start_unix for e in ev)

    writes = [e for e in ev if e.kind == timeline.WRITE]
    assert [e.checkpoint for e in writes] == [S10, S20, S30, S40, S50]
    assert all(e.bytes == N and e.seconds is not None and e.seconds > 0 for e in writes)
    assert all(a.end_unix <= b.start_unix for a, b in zip(writes, writes[1:], strict=False))   # saves were sequential

    archived = {e.checkpoint: e for e in ev if e.kind == timeline.ARCHIVE}
    for n in (S10, S20, S30):        # commit .. proven archived, from the blobs' Last-Modified
        a = archived[n]
        assert a.action == "proven" and a.start_unix == tl.of(n, timeline.WRITE)[0].end_unix
        assert a.seconds is not None and a.seconds >= 0
    for n in (S40, S50):             # never exported: open spans that say why
        assert archived[n].action == timeline.PENDING and archived[n].end_unix is None
        assert "not archived" in archived[n].detail

    decisions = [(e.checkpoint, e.action) for e in ev if e.kind == timeline.RETENTION]
    assert sorted(decisions) == sorted([(S10, "delete"), (S20, "delete"), (S30, "delete"), (S40, "blocked")])
    blocked = tl.of(S40, timeline.RETENTION)[0]
    assert "not archived" in blocked.detail
    for n in (S10, S20, S30):        # deleted only after it was proven archived
        assert archived[n].end_unix is not None and tl.of(n, timeline.RETENTION)[0].start_unix >= archived[n].end_unix

    (r,) = [e for e in ev if e.kind == timeline.RESTORE]
    assert (r.checkpoint, r.action) == (S20, "download") and r.bytes is not None and r.bytes >= N
    assert r.seconds is not None and r.seconds > 0
    assert r.start_unix >= tl.of(S20, timeline.RETENTION)[0].start_unix
    assert ev[-1] == r

    # Both tiers: deleted ones are found in the archive, the restored one is back.
    assert tl.tiers[S10] == tl.tiers[S30] == "only in archive"
    assert tl.tiers[S40] == tl.tiers[S50] == "not yet archived"
    assert tl.tiers[S20] in ("archived", "not yet archived")

    # Deleted again after its restore (no grace here): a second delete, after the restore.
    ret.apply(cfg, backend, ret.Policy.from_config(cfg.retention))
    again = timeline.gather(backend).of(S20, timeline.RETENTION)
    assert [e.action for e in again] == ["delete", "delete"] and again[1].start_unix >= r.end_unix
    # The async save says how long its caller was blocked.
    (w50,) = timeline.gather(backend).of(S50, timeline.WRITE)
    assert w50.action == "async_save" and "caller blocked" in w50.detail


def test_since_filters_and_json_is_the_drawn_data(lifecycle, capsys) -> None:
    cfg, backend, conf, tmp = lifecycle
    # A save three hours ago (history survives its checkpoint): inside 6h, outside 2h.
    old = {"kind": records.SAVE, "name": "global_epoch0_step5", "bytes": 1, "seconds": 1.0, "time_unix": time.time() - 3 * 3600}
    with open(records.records_dir(cfg.root, cfg.model) / records.HISTORY, "a") as f:
        f.write(json.dumps(old) + "\n")
    png = tmp / "out" / "timeline.png"
    assert cli.main(["timeline", "--config", str(conf), "--since", "6h", "--out", str(png), "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert got["ok"] and got["png"] == str(png)
    names = [e["checkpoint"] for e in got["events"] if e["kind"] == "write"]
    assert names == ["global_epoch0_step5", S10, S20, S30, S40, S50]
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000

    assert cli.main(["timeline", "--config", str(conf), "--since", "2h", "--json"]) == 0
    recent = json.loads(capsys.readouterr().out)["events"]
    assert "global_epoch0_step5" not in {e["checkpoint"] for e in recent}
    assert {e["kind"] for e in recent} == {"write", "archive", "retention", "restore"}

    # A cut just before the restore keeps the restore and the spans still open, nothing else.
    r = next(e for e in timeline.gather(backend).events if e.kind == timeline.RESTORE)
    late = timeline.gather(backend, since_unix=r.start_unix)
    assert {(e.kind, e.checkpoint) for e in late.events} == {
        ("restore", S20), ("archive", S40), ("archive", S50)} | ({("archive", S20)} if late.tiers[S20] != "archived" else set())

    assert cli.main(["timeline", "--config", str(conf), "--since", "soon"]) != 0
    assert "--since" in capsys.readouterr().err


def test_missing_matplotlib_is_one_clear_line(lifecycle, capsys, monkeypatch: pytest.MonkeyPatch) -> None:
    _, _, conf, tmp = lifecycle
    monkeypatch.setitem(sys.modules, "matplotlib", None)     # `import matplotlib` raises ImportError
    png = tmp / "t.png"
    code = cli.main(["timeline", "--config", str(conf), "--out", str(png)])
    err = capsys.readouterr().err
    assert code != 0 and not png.exists()
    assert "pip install 'tiered-ckpt[timeline]'" in err and "Traceback" not in err
    # The table needs no matplotlib.
    assert cli.main(["timeline", "--config", str(conf)]) == 0
    assert S20 in capsys.readouterr().out


def test_status_watch_refreshes_and_stops(lifecycle, capsys) -> None:
    _, _, conf, _ = lifecycle
    assert cli.main(["status", "--config", str(conf), "--watch", "--interval", "0.1", "--iterations", "2"]) == 0
    out = capsys.readouterr().out.splitlines()
    heads = [ln for ln in out if not ln.startswith("  ")]
    assert len(heads) == 2                                  # two snapshots, one line per fact (not a terminal)
    s20 = [ln for ln in out if ln.startswith(f"  checkpoint: {S20};")]
    assert len(s20) == 2 and "restores: download" in s20[0]
    assert any(ln.startswith(f"  checkpoint: {S40};") and "proven archived: not yet" in ln for ln in out)
    assert cli.main(["status", "--config", str(conf), "--watch", "--interval", "0.1", "--iterations", "2", "--json"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 2 and all(json.loads(ln)["tiers"][S10] == "only in archive" for ln in lines)
    # A watch flag without --watch is refused, not ignored.
    assert cli.main(["status", "--config", str(conf), "--since", "1h"]) != 0
    assert "--since only apply to status --watch" in capsys.readouterr().err


@pytest.mark.timeout(120)
def test_status_watch_ctrl_c_exits_zero(lifecycle) -> None:
    _, _, conf, _ = lifecycle
    env = {**os.environ, "PYTHONPATH": f"{REPO / 'src'}:{REPO}"}
    proc = subprocess.Popen([sys.executable, "-m", "tiered_ckpt.cli.app", "status", "--config", str(conf), "--watch",
                             "--interval", "0.2"], cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    first = proc.stdout.readline()
    assert "m (" in first, first
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    assert "Traceback" not in err
