"""Config and environment errors: one clear message naming the setting (or path) and the fix, the
right exit code, never a traceback. Each case runs the real CLI as a subprocess."""
from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import yaml

from tiered_ckpt import api, config
from tiered_ckpt.errors import EXIT_USAGE


def _cli(conf: Path, *argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "tiered_ckpt", *argv, "--config", str(conf)],
                          capture_output=True, text=True, timeout=120)


def _flat(p: subprocess.CompletedProcess[str]) -> str:
    return " ".join((p.stdout + p.stderr).split())


# (config text, the key the message must name, a word of the fix)
CASES = [
    ("root: 123\n", "root", "quote"),
    ("model: 5\n", "model", "quote"),
    ("archive:\n  prefix: 5\n", "archive.prefix", "quote"),
    ("archive:\n  connection_string: garbage\n", "archive.connection_string", "Key=Value"),
    ("amlfs:\n  provisioned_gbps: fast\n", "amlfs.provisioned_gbps", "number"),
    ("io:\n  direct: maybe\n", "io.direct", "true or false"),
    ("io:\n  threads: '8'\n", "io.threads", "whole number"),
    ("io:\n  block_size: [1]\n", "io.block_size", "size"),
    ("archive:\n  account_url: blob.example\n", "archive.account_url", "https://"),
    ("archive:\n  retries: -1\n", "archive.retries", ">= 0"),
    ("retention:\n  keep_newer_than: soon\n", "retention.keep_newer_than", "duration"),
    ("unknown_key: 1\n", "unknown_key", "known settings"),
    ("- a\n- b\n", "mapping", "key: value"),
    ("root: [unclosed\n", "YAML", "YAML"),
]


@pytest.mark.parametrize("text, key, fix", CASES, ids=[c[1] for c in CASES])
def test_bad_setting_is_one_message_naming_the_key(tmp_path: Path, text: str, key: str, fix: str) -> None:
    conf = tmp_path / "config.yaml"
    conf.write_text(text)
    for argv in (["list"], ["status", "--json"]):
        p = _cli(conf, *argv)
        assert p.returncode == EXIT_USAGE, _flat(p)
        assert "Traceback" not in p.stdout + p.stderr
        msg = json.loads(p.stdout)["error"] if "--json" in argv else _flat(p)
        assert key in msg and fix in msg, msg
        assert str(conf) in msg or "YAML" in msg


def test_connection_string_message_never_quotes_it(tmp_path: Path) -> None:
    conf = tmp_path / "config.yaml"
    conf.write_text("archive:\n  connection_string: 'AccountKeySECRETVALUE-no-equals-sign'\n")
    p = _cli(conf, "list")
    assert p.returncode == EXIT_USAGE and "archive.connection_string" in _flat(p)
    assert "SECRETVALUE" not in p.stdout + p.stderr


def test_booleans_are_strict_a_quoted_no_is_refused_never_true(tmp_path: Path) -> None:
    """Only YAML booleans are booleans (PyYAML reads YAML 1.1, so unquoted yes/no/on/off are too);
    a quoted word or a number is refused with the fix, never read as true."""
    conf = tmp_path / "c.yaml"
    for word, want in (("no", False), ("off", False), ("false", False), ("yes", True), ("true", True)):
        conf.write_text(f"io:\n  direct: {word}\n")
        assert config.load(str(conf)).io.direct is want, word
    for word in ('"no"', "'false'", '"yes"', "1", "0", '"true"'):
        conf.write_text(f"io:\n  direct: {word}\n")
        with pytest.raises(config.ConfigError) as e:
            config.load(str(conf))
        assert "io.direct" in str(e.value) and "direct: false" in str(e.value), word


def test_non_utf8_config_file(tmp_path: Path) -> None:
    conf = tmp_path / "config.yaml"
    conf.write_bytes(b"root: /caf\xe9\n")
    p = _cli(conf, "list")
    assert p.returncode == EXIT_USAGE and "Traceback" not in p.stderr
    assert "not UTF-8" in _flat(p) and str(conf) in _flat(p)


def test_several_problems_are_reported_together(tmp_path: Path) -> None:
    conf = tmp_path / "config.yaml"
    conf.write_text("root: 123\nmodel: 5\nio:\n  threads: 0\n  direct: maybe\narchive:\n  connection_string: garbage\n"
                    "amlfs:\n  provisioned_gbps: fast\n")
    p = _cli(conf, "list")
    assert p.returncode == EXIT_USAGE and "Traceback" not in p.stderr
    msg = _flat(p)
    assert "6 problems" in msg
    for key in ("root", "model", "io.threads", "io.direct", "archive.connection_string", "amlfs.provisioned_gbps"):
        assert f"{key}" in msg, key


# ---------------------------------------------------------------------------------------------
# A read-only checkpoint file system


@contextlib.contextmanager
def _read_only(src: Path, mnt: Path) -> Iterator[str]:
    """`mnt` shows `src` read-only: a read-only bind mount (EROFS, needs root) or, where mounting is
    not allowed, `chattr -R +i` on `src` itself (EPERM; an immutable tree refuses writes even to root).
    Yields the path to use and how it was made."""
    mnt.mkdir()
    ok = subprocess.run(["mount", "--bind", str(src), str(mnt)], capture_output=True).returncode == 0 and \
        subprocess.run(["mount", "-o", "remount,bind,ro", str(mnt)], capture_output=True).returncode == 0
    if ok:
        try:
            yield "erofs"
        finally:
            subprocess.run(["umount", "-l", str(mnt)], capture_output=True)
        return
    subprocess.run(["umount", str(mnt)], capture_output=True)
    mnt.rmdir()
    if shutil.which("chattr") and subprocess.run(["chattr", "-R", "+i", str(src)], capture_output=True).returncode == 0:
        mnt.symlink_to(src)
        try:
            yield "immutable"
        finally:
            subprocess.run(["chattr", "-R", "-i", str(src)], capture_output=True)
        return
    pytest.skip("neither a read-only bind mount nor chattr +i is possible here (the in-process EROFS test covers the CLI edge)")


def test_read_only_root_retention_export_restore(tmp_path: Path, azurite_container: tuple[str, str]) -> None:
    conn, container = azurite_container
    fs = tmp_path / "fs"                      # the file system; the checkpoint root is fs/checkpoints
    root = fs / "checkpoints"
    root.mkdir(parents=True)
    cfg_data = {"root": str(root), "model": "llama", "backend": "local",
                "io": {"threads": 2, "files_per_rank": 1, "block_size": "1MiB", "sync_buffer_bytes": "4MiB"},
                "archive": {"connection_string": conn, "container": container, "retries": 1},
                "retention": {"keep_last": 1, "min_keep": 1}}
    conf = tmp_path / "w.yaml"
    conf.write_text(yaml.safe_dump(cfg_data))
    cfg = config.load(str(conf))
    for step in (10, 20, 30):
        api.save({"w": np.full(8192, step, dtype=np.uint8)}, epoch=0, step=step, config=cfg)
    assert _cli(conf, "export", "--once").returncode == 0
    shutil.rmtree(root / "llama" / "global_epoch0_step10")        # only in the archive now
    (root / "llama" / "global_epoch0_step30" / "new.bin").write_bytes(b"x")   # something for export to do

    mnt = tmp_path / "ro"
    with _read_only(fs, mnt) as how:
        ro = tmp_path / "ro.yaml"
        ro.write_text(yaml.safe_dump({**cfg_data, "root": str(mnt / "checkpoints")}))
        runs = {
            "retention apply": _cli(ro, "retention", "apply"),
            "export --once": _cli(ro, "export", "--once"),
            "archive restore": _cli(ro, "restore", "global_epoch0_step10"),
            "archive restore --json": _cli(ro, "restore", "global_epoch0_step10", "--json"),
        }
    why = "Read-only file system" if how == "erofs" else "not permitted"
    for what, p in runs.items():
        flat = _flat(p)
        assert "Traceback" not in p.stdout + p.stderr, (what, flat)
        assert p.returncode in (1, 2, 3), (what, p.returncode, flat)     # never 0, never a crash
        assert why in flat, (what, flat)
        assert str(mnt) in flat, (what, flat)         # names the path
        if "--json" in what:
            assert json.loads(p.stdout)["ok"] is False
    # Nothing on the real tree changed.
    assert sorted(os.listdir(root / "llama")) == sorted(n for n in os.listdir(root / "llama"))
    assert not (root / "llama" / "global_epoch0_step10").exists()


def test_oserror_at_the_cli_edge_names_path_and_errno(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    """EROFS simulated in-process (os.open patched): whatever the library did not turn into its own
    message, the CLI turns into one line naming the path, the errno and the fix."""
    from tiered_ckpt.cli import app as cli

    root = tmp_path / "checkpoints"
    root.mkdir()
    conf = tmp_path / "c.yaml"
    conf.write_text(yaml.safe_dump({"root": str(root), "model": "llama", "backend": "local",
                                    "io": {"threads": 2, "files_per_rank": 1, "block_size": "1MiB",
                                           "sync_buffer_bytes": "4MiB"}}))
    real_open = os.open

    def ro_open(path, flags, *a, **k):  # noqa: ANN001,ANN002,ANN003,ANN202
        if str(path).startswith(str(root)) and flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT):
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(path))
        return real_open(path, flags, *a, **k)

    monkeypatch.setattr(os, "open", ro_open)
    import tiered_ckpt.cli.io as cmd_io

    def boom(*a, **k):  # noqa: ANN002,ANN003,ANN202
        os.open(str(root / "llama" / "x"), os.O_WRONLY | os.O_CREAT)

    monkeypatch.setattr(cmd_io, "cmd_list", boom)
    parser_rc = cli.main(["list", "--config", str(conf)])
    err = " ".join(capsys.readouterr().err.split())
    assert parser_rc == EXIT_USAGE
    assert f"{root}/llama/x: Read-only file system (EROFS)" in err and "remount it read-write" in err
    assert "Traceback" not in err
