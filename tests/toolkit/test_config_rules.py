"""The node config's typed rules: a malformed file gets one message listing every problem (key,
value, fix) and the config exit code, without a traceback; booleans are strict; sizes and
durations read the same in the file and in every flag."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import yaml

from tiered_ckpt import config
from tiered_ckpt.cli import app as cli
from tiered_ckpt.errors import EXIT_USAGE, ConfigError

BAD = """\
root: /lustrefs/checkpoints
model: "has space"
io:
  threds: 4
  direct: "no"
  block_size: 1000
  staging_bytes: lots
archive:
  timeout: soon
  retries: -1
retention:
  keep_last: 0
  action: purge
metrics: 7
"""
# (key, words of the fix), one per problem in BAD
EXPECTED = [
    ("model", "letters, digits"),
    ("io.threds", "did you mean threads?"),
    ("io.direct", "direct: false"),
    ("io.block_size", "multiple of 4 KiB"),
    ("io.staging_bytes", "64MiB"),
    ("archive.timeout", "90s"),
    ("archive.retries", ">= 0"),
    ("retention.keep_last", ">= 1"),
    ("retention.action", "delete or release"),
    ("metrics", "key: value"),
]


def test_malformed_config_lists_every_problem_once_without_a_traceback(tmp_path: Path) -> None:
    conf = tmp_path / "config.yaml"
    conf.write_text(BAD)
    env = {**os.environ, "COLUMNS": "40"}
    text = subprocess.run([sys.executable, "-m", "tiered_ckpt", "list", "--config", str(conf)],
                          capture_output=True, text=True, timeout=120, env=env)
    as_json = subprocess.run([sys.executable, "-m", "tiered_ckpt", "--json", "--config", str(conf), "status"],
                             capture_output=True, text=True, timeout=120, env=env)
    for p in (text, as_json):
        assert p.returncode == EXIT_USAGE, p.stderr
        assert "Traceback" not in p.stdout + p.stderr
    msg = json.loads(as_json.stdout)["error"]
    assert msg.startswith(f"{len(EXPECTED)} problems in the configuration (in {conf})"), msg
    lines = msg.splitlines()[1:]
    assert len(lines) == len(EXPECTED), msg
    by_key = {line.split(": ", 1)[0].removeprefix("  - "): line for line in lines}
    for key, fix in EXPECTED:
        assert fix in by_key[key], (key, by_key.get(key))
    # The text form is the same message, each problem on its own line, whatever $COLUMNS says.
    shown = [" ".join(line.split()) for line in text.stderr.splitlines()]
    for line in lines:
        assert " ".join(line.split()) in shown, line


@pytest.mark.parametrize("value", ['"no"', '"false"', '"off"', "0", "1", '"yes"'])
def test_a_boolean_must_be_a_yaml_boolean(tmp_path: Path, value: str) -> None:
    conf = tmp_path / "c.yaml"
    conf.write_text(f"io:\n  direct: {value}\n")
    with pytest.raises(ConfigError, match=r"io\.direct: .* is not true or false; write direct: true or direct: false"):
        config.load(str(conf))


SIZES = [("4GiB", 4 << 30), ("512MiB", 512 << 20), ("16M", 16_000_000), ("1.5G", 1_500_000_000), ("64KiB", 64 << 10),
         ("4096", 4096), (8192, 8192), ("2 GiB", 2 << 30)]
DURATIONS = [("6h", 21600.0), ("30m", 1800.0), ("90s", 90.0), ("2d", 172800.0), ("1w", 604800.0), (45, 45.0),
             ("45", 45.0), ("1.5h", 5400.0)]


@pytest.mark.parametrize("text, want", SIZES)
def test_sizes_read_the_same_everywhere(tmp_path: Path, text: str | int, want: int) -> None:
    conf = tmp_path / "c.yaml"
    conf.write_text(yaml.safe_dump({"io": {"staging_bytes": text, "sync_buffer_bytes": text}}))
    cfg = config.load(str(conf))
    assert cfg.io.staging_bytes == cfg.io.sync_buffer_bytes == config.parse_size(text) == want
    assert config.parse_size(config.format_size(want)) == want          # what help shows reads back


@pytest.mark.parametrize("text, want", DURATIONS)
def test_durations_read_the_same_in_the_file_and_in_flags(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                          text: str | int, want: float) -> None:
    root = tmp_path / "root"
    root.mkdir()
    conf = tmp_path / "c.yaml"
    conf.write_text(yaml.safe_dump({"root": str(root), "backend": "local",
                                    "retention": {"restore_grace": text, "keep_newer_than": text}}))
    cfg = config.load(str(conf))
    assert cfg.retention.restore_grace == cfg.retention.keep_newer_than == config.parse_duration(text) == want
    assert config.parse_duration(config.format_duration(want)) == want
    # The flags go through the same parser: the policy a run would use is the same.
    plain = tmp_path / "plain.yaml"
    plain.write_text(yaml.safe_dump({"root": str(root), "backend": "local"}))
    policies = []
    for argv in (["--config", str(conf)], ["--config", str(plain), "--restore-grace", str(text), "--keep-newer-than", str(text)]):
        assert cli.main(["retention", "plan", "--json", *argv]) == 0
        policies.append(json.loads(capsys.readouterr().out)["policy"])
    assert policies[0] == policies[1] and policies[0]["restore_grace"] == want


@pytest.mark.parametrize("bad", ["soon", "-5", "5 hours", "", [1], True])
def test_a_bad_duration_flag_or_setting_names_itself(tmp_path: Path, bad: object) -> None:
    with pytest.raises(ConfigError, match="--restore-grace: .* is not a duration"):
        config.parse_duration(bad, "--restore-grace")  # type: ignore[arg-type]
    conf = tmp_path / "c.yaml"
    conf.write_text(yaml.safe_dump({"retention": {"restore_grace": bad}}))
    with pytest.raises(ConfigError, match=r"retention\.restore_grace: .* is not a duration"):
        config.load(str(conf))


def test_unknown_keys_are_refused_with_a_suggestion(tmp_path: Path) -> None:
    conf = tmp_path / "c.yaml"
    conf.write_text("rot: /x\nretention:\n  keep_lats: 3\n  zzz: 1\nsource: /etc/other.yaml\nthreads: 4\n")
    with pytest.raises(ConfigError) as e:
        config.load(str(conf))
    msg = str(e.value)
    assert "5 problems" in msg
    assert "threads: unknown setting; did you mean io.threads?" in msg            # a setting in the wrong section
    assert "rot: unknown setting; did you mean root?" in msg
    assert "retention.keep_lats: unknown setting; did you mean keep_last?" in msg
    assert "retention.zzz: unknown setting (known settings in retention: action, keep_every_steps" in msg
    assert "source: unknown setting" in msg        # where a config came from is not a setting


def test_overrides_from_flags_are_checked_by_the_same_rules(tmp_path: Path) -> None:
    cfg = config.NodeConfig(root=str(tmp_path), backend="local")
    with pytest.raises(ConfigError, match="model: 'a b' must be letters"):
        cfg.with_overrides(model="a b")
    with pytest.raises(ConfigError, match="retention.action: release .* needs backend amlfs"):
        config.validate(config.NodeConfig(backend="local", retention=config.RetentionConfig(action="release")))
    assert cfg.with_overrides(model="llama-7b").model == "llama-7b"


def test_dump_loads_back_identically(tmp_path: Path) -> None:
    cfg = config.NodeConfig(root="/lustrefs/ckpt", model="m", io=config.IoConfig(threads=3, block_size=8 << 20),
                            retention=config.RetentionConfig(keep_newer_than=3600.0))
    conf = tmp_path / "c.yaml"
    conf.write_text(config.dump(cfg))
    back = config.load(str(conf))
    assert replace(back, source=None) == cfg and back.source == str(conf) and "io.threads" in back.given


def test_an_empty_section_means_its_defaults(tmp_path: Path) -> None:
    conf = tmp_path / "c.yaml"
    conf.write_text("io:\n  # threads: 4\nretention:\narchive:\n  retries: 1\n")
    cfg = config.load(str(conf))
    assert cfg.io == config.IoConfig() and cfg.retention == config.RetentionConfig() and cfg.archive.retries == 1
