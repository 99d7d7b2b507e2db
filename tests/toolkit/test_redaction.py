"""No credential ever reaches stdout or stderr: a SAS connection string against a dead port.

The service URL of a SAS connection string carries the token in its query string, and SDK
errors quote request URLs; every command's errors, warnings and --json must show neither.
"""
from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml

from tiered_ckpt import api, config
from tiered_ckpt.redact import redact, safe_url

SECRET = "SECRETSIGabc123XYZ%2Bq%3D"
KEY = "S3CRETACCOUNTKEYbase64+/=="


def _dead_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])      # closed on exit: nothing listens there


@pytest.fixture(scope="module")
def sas_setup(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    tmp = tmp_path_factory.mktemp("sas")
    conn = (f"BlobEndpoint=http://127.0.0.1:{_dead_port()}/devstoreaccount1;"
            f"SharedAccessSignature=sv=2024-08-04&ss=b&srt=sco&sp=rwdlac&se=2030-01-01T00:00:00Z&spr=http&sig={SECRET}")
    root = tmp / "checkpoints"
    root.mkdir()
    conf = tmp / "config.yaml"
    conf.write_text(yaml.safe_dump({
        "root": str(root), "model": "llama", "backend": "local",
        "io": {"threads": 2, "files_per_rank": 1, "block_size": "1MiB", "sync_buffer_bytes": "4MiB"},
        "archive": {"connection_string": conn, "container": "ckpt", "retries": 1},
        "retention": {"keep_last": 1, "min_keep": 1},
    }))
    cfg = config.load(str(conf))
    for step in (10, 20, 30):
        # the archive is a dead port on purpose: the save says so and goes on, as asked
        api.save({"w": np.full(4096, step, dtype=np.uint8)}, epoch=0, step=step, config=cfg,
                 archive_check="best_effort")
    return conf, tmp


def _leaks(text: str) -> bool:
    return "SECRETSIG" in text or "S3CRETACCOUNTKEY" in text


@pytest.mark.parametrize("argv", [
    ["restore", "--latest"],
    ["restore", "global_epoch9_step9"],
    ["status"],
    ["export", "--once"],
    ["retention", "apply"],
])
@pytest.mark.parametrize("as_json", [False, True])
def test_no_command_prints_the_sas_token(sas_setup: tuple[Path, Path], argv: list[str], as_json: bool) -> None:
    conf, tmp = sas_setup
    extra = ["--json"] if as_json else []
    if argv[0] in ("status", "export"):
        extra += ["--export-status", str(tmp / "export-status.json")]
    if argv[0] == "restore":
        # Nothing resident: the checkpoint must come from the (unreachable) archive.
        extra += ["--root", str(tmp / "empty-root")]
    p = subprocess.run([sys.executable, "-m", "tiered_ckpt", *argv, "--config", str(conf), *extra],
                       capture_output=True, text=True, timeout=120, env={**os.environ, "COLUMNS": "60"})
    both = p.stdout + p.stderr
    assert not _leaks(both), both
    assert "Traceback" not in both, both
    # The command did reach the archive's failure (the test would be empty otherwise) and says where.
    assert "127.0.0.1" in both and ("unreachable" in both or "failed" in both or "archive" in both), both


def test_redact_covers_every_credential_form() -> None:
    cases = [
        f"BlobEndpoint=http://h/a;SharedAccessSignature=sv=2024&sig={SECRET};QueueEndpoint=x",
        f"DefaultEndpointsProtocol=https;AccountName=a;AccountKey={KEY};EndpointSuffix=core.windows.net",
        f"Max retries exceeded with url: /devstoreaccount1/ckpt?restype=container&comp=list&sv=2024&sig={SECRET}",
        f"https://a.blob.core.windows.net/c/b?se=2030&sp=r&sig={SECRET}&sr=b",
        f"{{'Authorization': 'Bearer {SECRET}'}}",
        f"Authorization: SharedKey acct:{SECRET}",
        f'{{"access_token": "{SECRET}", "expires_in": 3599}}',
        f"token sv=2024&sig={SECRET}",
        f"url%3Fsv%3D2024%26sig%3D{SECRET}",
    ]
    for c in cases:
        out = redact(c)
        assert not _leaks(out), (c, out)
        assert redact(out) == out
    assert redact("container 'ckpt' at http://127.0.0.1:1/devstoreaccount1") == \
        "container 'ckpt' at http://127.0.0.1:1/devstoreaccount1"
    assert safe_url(f"http://127.0.0.1:1/devstoreaccount1?sv=2024&sig={SECRET}") == "http://127.0.0.1:1/devstoreaccount1"


def test_json_and_error_output_are_redacted_in_process(capsys: pytest.CaptureFixture[str]) -> None:
    from tiered_ckpt.cli.output import print_error, print_json, stderr

    print_json({"error": f"at http://h/c?sig={SECRET}", f"k?sig={SECRET}": [f"AccountKey={KEY}"]})
    print_error(f"refused: http://h/c?sv=1&sig={SECRET}")
    stderr.print(f"[yellow]warning:[/] listing failed: ...&sig={SECRET} " + "x" * 200)
    import logging

    from tiered_ckpt import logs

    logs.configure("text", "warning")      # what the CLI installs: logging goes through the redacting handler
    logging.getLogger("azure.core").warning("request to %s failed", f"http://h/c?sig={SECRET}")
    out, err = capsys.readouterr()
    assert not _leaks(out + err), out + err
    assert "REDACTED" in out and "REDACTED" in err


def test_arm_errors_are_redacted() -> None:
    from azure.core.exceptions import ClientAuthenticationError, ServiceRequestError

    from tiered_ckpt.tiers.arm import AmlfsTarget
    from tiered_ckpt.tiers.arm_errors import translate

    t = AmlfsTarget("sub", "rg", "fs", "job")
    for err in (ClientAuthenticationError(f'token request failed: {{"access_token": "{SECRET}"}}'),
                ServiceRequestError(f"GET https://management.azure.com/x?sig={SECRET} Authorization: Bearer {SECRET}")):
        e = translate(err, t, "read the job", "/subscriptions/sub/x")
        assert not _leaks(str(e)) and "REDACTED" in str(e), str(e)
