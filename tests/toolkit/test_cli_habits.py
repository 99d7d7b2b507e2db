"""Command-line habits of az/kubectl: --version, global flags on either side of the subcommand,
group help listing the subcommands' flags, help with the config's effective defaults, --json on
every command, and piped output that never wraps a line."""
from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml

from tiered_ckpt import api, config
from tiered_ckpt.cli import app as cli
from tiered_demo.cli import register as demo_register


def _cli(*argv: str, columns: int = 40, **kw: object) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "COLUMNS": str(columns), "TIERED_CKPT_CONFIG": os.devnull}
    return subprocess.run([sys.executable, "-m", "tiered_ckpt", *argv], capture_output=True, text=True,
                          timeout=120, env=env, **kw)  # type: ignore[call-overload]


def _help(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, *argv: str) -> str:
    """`tiered-ckpt ARGV` (which asks for help) in this process, its output with whitespace folded."""
    monkeypatch.setenv("COLUMNS", "1000")           # argparse wraps help at $COLUMNS
    monkeypatch.setenv("TIERED_CKPT_CONFIG", os.devnull)
    with pytest.raises(SystemExit) as e:
        cli.main(list(argv))
    assert e.value.code == 0
    return " ".join(capsys.readouterr().out.split())


def _leaves(p: argparse.ArgumentParser, path: tuple[str, ...] = ()) -> list[tuple[tuple[str, ...], argparse.ArgumentParser]]:
    subs = [a for a in p._actions if isinstance(a, argparse._SubParsersAction)]
    if not subs:
        return [(path, p)]
    return [leaf for name, child in subs[0].choices.items() for leaf in _leaves(child, (*path, name))]


def test_version_comes_from_the_package_metadata() -> None:
    p = _cli("--version")
    assert p.returncode == 0 and p.stdout.strip() == f"tiered-ckpt {importlib.metadata.version('tiered-ckpt')}"


def test_every_command_has_json_and_the_global_flags_on_both_sides() -> None:
    parser = cli.build_parser((*cli.COMMANDS, demo_register))
    leaves = _leaves(parser)
    assert len(leaves) >= 10
    globals_ = [o for a in cli.common_parser()._actions for o in a.option_strings]
    for path, leaf in leaves:
        for flag in globals_:
            assert flag in leaf._option_string_actions, (path, flag)
        pos = ["x"] * sum(1 for a in leaf._actions if not a.option_strings and a.nargs is None)
        need = [o for a in leaf._actions if a.required and a.option_strings for o in a.option_strings[:1]]
        rest = [*pos, *[v for o in need for v in (o, "1GiB")]]
        before = parser.parse_args(["--json", "--root", "/r", "--model", "m", *path, *rest])
        after = parser.parse_args([*path, *rest, "--json", "--root", "/r", "--model", "m"])
        plain = parser.parse_args([*path, *rest])
        assert before.json is after.json is True and plain.json is False, path
        assert before.root == after.root == "/r" and before.model == after.model == "m" and plain.root is None, path


def test_global_flags_before_the_subcommand_give_the_same_run(tmp_path: Path) -> None:
    root = tmp_path / "root"
    root.mkdir()
    api.save({"w": np.zeros(16, np.uint8)}, epoch=0, step=1, root=root, model="m",
             config=config.NodeConfig(root=str(root), model="m", backend="local"))
    conf = tmp_path / "c.yaml"
    conf.write_text(yaml.safe_dump({"root": str(root), "model": "m", "backend": "local"}))
    g = ["--config", str(conf), "--json"]
    a, b, c = _cli(*g, "list"), _cli("list", *g), _cli("--json", "list", "--config", str(conf))
    assert a.returncode == b.returncode == c.returncode == 0, a.stderr + b.stderr + c.stderr
    assert json.loads(a.stdout) == json.loads(b.stdout) == json.loads(c.stdout)
    assert [x["name"] for x in json.loads(a.stdout)["checkpoints"]] == ["global_epoch0_step1"]


def test_group_help_lists_each_subcommand_with_its_flags(capsys: pytest.CaptureFixture[str],
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    out = _help(capsys, monkeypatch, "retention", "--help")
    for text in ("retention plan [-h]", "retention apply [-h]", "plan: show every checkpoint's decision",
                 "apply: delete/release what the plan allows", "--keep-last N", "--keep-newer-than DURATION",
                 "--action {delete,release}"):
        assert text in out, text
    assert out.count("--restore-grace DURATION") >= 4          # usage and flag list of both
    nested = _help(capsys, monkeypatch, "archive", "--help")
    for text in ("archive retention plan [-h]", "retention plan: show every archived checkpoint's decision",
                 "retention apply:", "--lustre-gone"):
        assert text in nested, text


def test_help_shows_the_effective_defaults_from_the_config(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    conf = tmp_path / "node.yaml"
    conf.write_text(yaml.safe_dump({"io": {"threads": 3, "block_size": "8MiB"}, "retention": {"keep_newer_than": "6h"},
                                    "metrics": {"port": 9999}}))
    bench = _help(capsys, monkeypatch, "bench", "--help", "--config", str(conf))
    assert f"--threads THREADS writer/reader threads (default: 3, io.threads from {conf})" in bench
    assert f"(default: 8MiB, io.block_size from {conf})" in bench
    assert "--files FILES shard files (default: 8, built-in io.files_per_rank)" in bench
    assert "(default: true, built-in io.direct)" in bench
    assert f"(default: 6h, retention.keep_newer_than from {conf})" in _help(capsys, monkeypatch, "--config", str(conf),
                                                                            "retention", "plan", "-h")
    assert f"(default: 9999, metrics.port from {conf})" in _help(capsys, monkeypatch, "metrics", "--help", "--config", str(conf))
    # Without a file: the built-in values, said to be built in.
    assert "--threads THREADS writer/reader threads (default: 8, built-in io.threads)" in _help(capsys, monkeypatch,
                                                                                                "bench", "--help")


def test_help_still_works_when_the_config_is_broken_and_the_run_reports_it(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    conf = tmp_path / "bad.yaml"
    conf.write_text("io:\n  threads: many\n")
    assert "(default: 8, built-in io.threads)" in _help(capsys, monkeypatch, "bench", "--help", "--config", str(conf))
    assert cli.main(["bench", "--size", "1MiB", "--config", str(conf)]) == 2
    err = capsys.readouterr().err
    assert "io.threads: 'many' is not a whole number" in err and "Traceback" not in err


def test_piped_output_is_one_line_per_fact(tmp_path: Path) -> None:
    """COLUMNS=40 and a pipe: rich would wrap at 40 (or at 80/150 before); each fact stays one line."""
    root = tmp_path.joinpath(*(["a-rather-long-directory-name-for-checkpoints"] * 5))
    root.mkdir(parents=True)
    model = "model-with-a-long-name-to-make-the-table-wider-than-forty-columns"
    cfg = config.NodeConfig(root=str(root), model=model, backend="local")
    for step in (1, 2):
        api.save({"w": np.zeros(16, np.uint8)}, epoch=0, step=step, config=cfg)
    (root / model / "global_epoch0_step3").mkdir()                   # not committed: a note line
    conf = tmp_path / "c.yaml"
    conf.write_text(yaml.safe_dump({"root": str(root), "model": model, "backend": "local"}))
    p = _cli("list", "--config", str(conf))
    assert p.returncode == 0, p.stderr
    lines = p.stdout.splitlines()
    assert len(str(root)) > 200 and str(root / model) in lines                   # the title, whole
    assert "latest committed: global_epoch0_step2" in lines
    rows = [line for line in lines if "global_epoch0_step" in line and "│" in line]
    assert len(rows) == 3 and all(line.count("│") == 7 for line in rows), lines
    # An error on stderr is one line too.
    e = _cli("verify", "global_epoch0_step3", "--config", str(conf))
    assert e.returncode == 1
    first = e.stderr.splitlines()[0]
    assert first.startswith("error: global_epoch0_step3 is not complete and intact:") and len(first) > 40
