"""Local mode by hand, as the README's section runs it: the example config against a real Azurite,
`export` of the given model only (a restored file is not uploaded again), a mistyped --model naming
the models that exist (non-zero exit), and the documented Azurite command line without telemetry."""
from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import yaml

import tiered_ckpt as tc
from tiered_ckpt.cli.app import main
from tiered_ckpt.config import load as load_config
from tiered_ckpt.tiers.blob import BlobStore

REPO = Path(__file__).resolve().parents[2]


def _conf(tmp_path: Path, conn: str, container: str) -> Path:
    d = yaml.safe_load((REPO / "examples" / "local.yaml").read_text())
    d["root"] = str(tmp_path / "lustre")
    d["archive"].update(container=container, retries=1)
    # the example's endpoint is Azurite's default port; the suite's Azurite runs on a free one
    assert "127.0.0.1:10000" in d["archive"]["connection_string"]
    d["archive"]["connection_string"] = conn
    p = tmp_path / "local.yaml"
    p.write_text(yaml.safe_dump(d))
    return p


def _run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    rc = main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


@pytest.mark.parametrize("doc, heading", [("README.md", "## Quick start: local mode"),
                                          ("docs/toolkit.md", "## Local mode by hand")])
def test_the_docs_start_azurite_without_telemetry_and_with_the_sdks_api_version(doc: str, heading: str) -> None:
    text = (REPO / doc).read_text()
    section = text[text.index(heading):]
    cmd = re.search(r"^.*azurite-blob .*$", section, re.M)
    assert cmd is not None and "--blobHost 127.0.0.1" in cmd.group(0)
    # Telemetry off (Azurite sends usage data otherwise); the locked azure-storage-blob speaks a newer
    # API version than Azurite knows, which it refuses without --skipApiVersionCheck.
    assert "--disableTelemetry" in cmd.group(0) and "--skipApiVersionCheck" in cmd.group(0)
    assert "examples/local.yaml" in section


def test_export_uploads_the_given_model_once_and_a_typo_names_the_models(
        tmp_path: Path, azurite_container: tuple[str, str], capsys: pytest.CaptureFixture[str]) -> None:
    conn, container = azurite_container
    conf = _conf(tmp_path, conn, container)
    cfg = load_config(str(conf))
    assert cfg.backend == "local" and cfg.model == "demo"
    (tmp_path / "lustre").mkdir()
    tc.save({"w": b"x" * 4096}, epoch=0, step=1, config=cfg)
    tc.save({"w": b"y" * 4096}, epoch=0, step=1, config=cfg.with_overrides(model="other"))

    rc, out, _ = _run(capsys, "export", "--once", "--json", "--config", str(conf))
    assert rc == 0, out
    names = set(BlobStore(cfg.archive).listing(""))
    assert names and all(n.startswith("demo/") for n in names), names      # not the other model

    # A restored checkpoint is not uploaded again (same bytes, new mtime).
    shutil.rmtree(tmp_path / "lustre" / "demo")
    rc, out, err = _run(capsys, "restore", "--latest", "--json", "--config", str(conf))
    assert rc == 0, err
    rc, out, _ = _run(capsys, "export", "--once", "--json", "--config", str(conf))
    got = json.loads(out)
    assert rc == 0 and got["files_discovered"] == 0 and got["files_exported"] == 0, got

    # --all-models exports the whole root, as AMLFS does
    rc, out, _ = _run(capsys, "export", "--once", "--json", "--all-models", "--config", str(conf))
    assert rc == 0 and any(n.startswith("other/") for n in BlobStore(cfg.archive).listing(""))

    for cmd in (["export", "--once"], ["list"]):
        rc, out, err = _run(capsys, *cmd, "--model", "dmeo", "--config", str(conf))
        assert rc != 0, (cmd, out)
        assert "model 'dmeo'" in err and "demo, other" in err, err
