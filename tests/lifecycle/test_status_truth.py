"""`tiered-ckpt status` tells the truth: each part it could not check (lfs failing, ARM refusing, the
archive unreachable or refusing the credential) is UNKNOWN with the reason, in text and --json, never
"backlog: 0 files"; the exit code says so (0 healthy, 1 a problem found, 3 some part UNKNOWN)."""
from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path
from typing import Any

import pytest

from tests.doubles.arm_fixtures import use_identity
from tests.lifecycle.helpers import FAKE_LFS, amlfs_cfg, local_cfg, make_checkpoint
from tiered_ckpt.cli import app as cli
from tiered_ckpt.config import ArchiveConfig, NodeConfig, dump
from tiered_ckpt.errors import EXIT_FAILED, EXIT_OK, EXIT_UNAVAILABLE
from tiered_ckpt.lifecycle.exporter import Exporter
from tiered_ckpt.tiers.blob import BlobStore


def status(cfg: NodeConfig, tmp_path: Path, capsys: pytest.CaptureFixture[str], *flags: str) -> tuple[int, Any]:
    conf = tmp_path / "status.yaml"
    conf.write_text(dump(cfg))
    rc = cli.main(["status", "--config", str(conf), *flags])
    out = capsys.readouterr().out
    return rc, json.loads(out) if "--json" in flags else out


def checks(st: dict[str, Any]) -> dict[str, tuple[str, str]]:
    return {c["part"]: (c["state"], c["reason"]) for c in st["checks"]}


@pytest.fixture
def local(tmp_path: Path, azurite_container: tuple[str, str]) -> NodeConfig:
    conn, container = azurite_container
    root = tmp_path / "lustre"
    root.mkdir()
    cfg = local_cfg(root, conn, container, keep_last=2, min_keep=2)
    for s in (10, 20):
        make_checkpoint(root, "m", 0, s)
    Exporter(cfg, BlobStore(cfg.archive, backoff=0.01)).iterate()    # its status file where status looks
    return cfg


def test_healthy_is_exit_0_with_every_part_checked(local: NodeConfig, tmp_path: Path, capsys) -> None:
    rc, st = status(local, tmp_path, capsys, "--json")
    assert rc == EXIT_OK and st["health"] == "healthy" and st["ok"] and st["exit_code"] == 0
    assert {p: s for p, (s, _) in checks(st).items()} == {
        "markers": "ok", "archive": "ok", "backlog": "ok", "export": "ok", "capacity": "ok", "locking": "ok",
        "records": "ok"}
    assert st["backlog"]["files"] == 0
    rc, text = status(local, tmp_path, capsys)
    assert rc == EXIT_OK and "export backlog: 0 files" in text and "health: healthy (exit 0)" in text


def _closed_port(cfg: NodeConfig) -> NodeConfig:
    return cfg.with_overrides(archive=ArchiveConfig(
        connection_string="DefaultEndpointsProtocol=http;AccountName=devstoreaccount1;AccountKey=a2V5;"
                          "BlobEndpoint=http://127.0.0.1:9/devstoreaccount1", container="c", retries=0, timeout=2))


def test_unreachable_archive_is_unknown_not_zero(local: NodeConfig, tmp_path: Path, capsys) -> None:
    dead = _closed_port(local)
    rc, st = status(dead, tmp_path, capsys, "--json")
    assert rc == EXIT_UNAVAILABLE == st["exit_code"] and st["health"] == "unknown" and not st["ok"]
    c = checks(st)
    assert c["archive"][0] == "UNKNOWN" and "unreachable" in c["archive"][1] and "127.0.0.1:9" in c["archive"][1]
    assert c["backlog"][0] == "UNKNOWN" and st["backlog"]["files"] is None and st["backlog"]["bytes"] is None
    assert c["markers"][0] == "ok" and c["export"][0] == "ok"
    # Committed checkpoints are still listed, their archive state said to be unknown.
    assert [(x["tier"], "unknown" in x["detail"]) for x in st["checkpoints"]] == [("resident", True)] * 2
    rc, text = status(dead, tmp_path, capsys)
    assert rc == EXIT_UNAVAILABLE
    assert "export backlog: UNKNOWN" in text and not re.search(r"backlog: 0 files", text)
    assert re.search(r"^check archive: UNKNOWN: .*unreachable", text, re.M) and "health: unknown (exit 3)" in text


def test_archive_refusing_the_credential_is_unknown(local: NodeConfig, tmp_path: Path, capsys) -> None:
    conn = local.archive.connection_string
    assert conn and "AccountKey=" in conn
    wrong = re.sub(r"AccountKey=[^;]+", "AccountKey=" + "d3Jvbmcta2V5LXdyb25nLWtleQ==", conn)
    cfg = local.with_overrides(archive=ArchiveConfig(connection_string=wrong, container=local.archive.container,
                                                     prefix="checkpoints", retries=0, timeout=5))
    rc, st = status(cfg, tmp_path, capsys, "--json")
    assert rc == EXIT_UNAVAILABLE
    state, reason = checks(st)["archive"]
    assert state == "UNKNOWN" and ("403" in reason or "auth" in reason.lower()), reason
    assert "d3Jvbmcta2V5" not in json.dumps(st)


def test_invalid_marker_is_a_problem_exit_1(local: NodeConfig, tmp_path: Path, capsys) -> None:
    d = make_checkpoint(local.root, "m", 0, 30)
    (d / "COMMITTED.json").write_text("{not json")
    Exporter(local, BlobStore(local.archive, backoff=0.01)).iterate()
    rc, st = status(local, tmp_path, capsys, "--json")
    assert rc == EXIT_FAILED and st["health"] == "problems"
    state, reason = checks(st)["markers"]
    assert state == "PROBLEM" and "global_epoch0_step30" in reason
    # A problem found outranks a part that is also unknown.
    rc, st = status(_closed_port(local), tmp_path, capsys, "--json")
    assert rc == EXIT_FAILED and checks(st)["archive"][0] == "UNKNOWN"


# -- AMLFS: fake lfs, Azurite, the ARM double ------------------------------------------------

def auto_export(root: str, store: BlobStore) -> None:
    paths = [str(p) for p in Path(root).rglob("*") if p.is_file()
             and not any(x.startswith(".") for x in p.relative_to(root).parts)]
    for p in paths:
        store.upload_file(p, Path(p).relative_to(root).as_posix())
    subprocess.run([str(FAKE_LFS), "hsm_archive", *paths], check=True)


@pytest.fixture
def aml(tmp_path: Path, azurite_container: tuple[str, str], fake_lfs: Path, arm_env) -> tuple[NodeConfig, Any]:
    conn, container = azurite_container
    root = tmp_path / "lustrefs" / "checkpoints"
    root.mkdir(parents=True)
    cfg = amlfs_cfg(root, conn, container, batch=4).with_overrides(amlfs=arm_env.config_values())
    cfg = cfg.with_overrides(amlfs={"lfs": str(FAKE_LFS)})
    for s in (10, 20):
        make_checkpoint(root, "m", 0, s)
    auto_export(str(root), BlobStore(cfg.archive, backoff=0.01))
    return cfg, arm_env


def test_amlfs_healthy_then_lfs_failing_is_unknown(aml, tmp_path: Path, capsys) -> None:
    cfg, _ = aml
    rc, st = status(cfg, tmp_path, capsys, "--json")
    assert rc == EXIT_OK, st["checks"]
    assert checks(st)["lfs"][0] == "ok" and {c["tier"] for c in st["checkpoints"]} == {"archived"}
    broken = tmp_path / "lfs"
    broken.write_text("#!/bin/sh\necho 'lfs hsm_state: cannot get HSM state: Transport endpoint is not connected' >&2\n"
                      "exit 107\n")
    broken.chmod(0o755)
    rc, st = status(cfg.with_overrides(amlfs={"lfs": str(broken)}), tmp_path, capsys, "--json")
    assert rc == EXIT_UNAVAILABLE
    c = checks(st)
    assert c["lfs"][0] == "UNKNOWN" and "Transport endpoint is not connected" in c["lfs"][1]
    assert c["backlog"][0] == "UNKNOWN" and st["backlog"]["files"] is None
    assert c["archive"][0] == "ok" and c["export"][0] == "ok"
    assert {c["tier"] for c in st["checkpoints"]} == {"resident"}
    assert all("lfs could not be checked" in x["detail"] for x in st["checkpoints"])


def test_arm_refusing_is_unknown_and_a_failed_job_is_a_problem(aml, tmp_path: Path, capsys,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    cfg, arm = aml
    use_identity(monkeypatch, "token-without-roles")        # the double answers 403 AuthorizationFailed
    rc, st = status(cfg, tmp_path, capsys, "--json")
    assert rc == EXIT_UNAVAILABLE
    state, reason = checks(st)["export"]
    assert state == "UNKNOWN" and re.search(r"403|authoriz|permission", reason, re.I), reason
    assert checks(st)["lfs"][0] == "ok" and st["backlog"]["files"] == 0
    rc, text = status(cfg, tmp_path, capsys)
    assert rc == EXIT_UNAVAILABLE and "export job: UNKNOWN: AMLFS auto-export" in text
    from tests.doubles.arm_double import NODE_TOKEN

    use_identity(monkeypatch, NODE_TOKEN)
    arm.scenario.autoexport = {**arm.scenario.autoexport, "state": "Failed", "statusMessage": "quota exceeded"}
    rc, st = status(cfg, tmp_path, capsys, "--json")
    assert rc == EXIT_FAILED
    state, reason = checks(st)["export"]
    assert state == "PROBLEM" and "Failed" in reason and "quota exceeded" in reason


def test_metrics_mark_the_archive_unchecked_when_lfs_fails(aml, tmp_path: Path, capsys) -> None:
    cfg, _ = aml
    broken = tmp_path / "lfs"
    broken.write_text("#!/bin/sh\necho 'lfs: not a Lustre file system' >&2\nexit 1\n")
    broken.chmod(0o755)
    conf = tmp_path / "m.yaml"
    conf.write_text(dump(cfg.with_overrides(amlfs={"lfs": str(broken)})))
    assert cli.main(["metrics", "--config", str(conf), "--json"]) == 0
    samples = json.loads(capsys.readouterr().out)["samples"]
    assert samples["tiered_ckpt_check_ok{model=m,part=archive}"] == 0
    assert not any(k.startswith("tiered_ckpt_export_backlog") for k in samples)
    assert samples["tiered_ckpt_newest_committed_step{model=m}"] == 20
