"""Bad input on the command line ends in one clear message, never a traceback or a hang: every
option that takes a value, of every command, with values a typo or a script produces (not a
number, NaN, infinities, negative, overflowing), and every command given a config file that is
not one (/dev/zero, a FIFO, a YAML alias bomb, a huge file, a directory).

All cases run in one child process (the toolkit imported once), each under an alarm: a case
still running after ALARM seconds is a hang, reported as such, unless it is a command that runs
until stopped (serve, watch) given a value it accepts."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tiered_ckpt.cli import app as cli

ALARM = 20      # seconds; the first case of a command pays its lazy imports on a busy machine
VALUES = ["x", "nan", "-1", "1e400", "99999999999999999999999"]
# Options that name a path: given a FIFO and a directory instead of a value.
PATH_DESTS = {"dir", "textfile", "export_status", "out"}
# Flags the option needs to take effect; the positional arguments of a command.
CONTEXT = {"bench": ["--size=64KiB"], "verify": ["global_epoch0_step1"], "restore": ["global_epoch0_step1"],
           "metrics --port": ["--serve"], "metrics --addr": ["--serve"],
           "status --interval": ["--watch", "--iterations=2"], "status --iterations": ["--watch", "--interval=0.01"],
           "status --since": ["--watch", "--iterations=1"], "export --interval": ["--watch"]}
RUNS_UNTIL_STOPPED = ("metrics --port", "metrics --addr", "export --interval", "status --iterations")
SKIP_DESTS = {"config", "root", "model", "help", "log_format", "log_level", "backend", "version"}


def _commands() -> list[tuple[str, list[tuple[str, str]]]]:
    """(command words, options that take a free-form value) of every leaf command."""
    out = []
    for leaf, _ in cli._leaves(cli.build_parser()):
        words = leaf.prog.split()[1:]
        opts = [(a.option_strings[-1], a.dest) for a in leaf._actions
                if a.option_strings and a.nargs is None and not a.choices and a.const is None
                and a.dest not in SKIP_DESTS and not isinstance(a.default, bool)]
        out.append((" ".join(words), opts))
    return out


COMMANDS = _commands()

CHILD = r"""
import contextlib, io, json, signal, sys, time, traceback
from tiered_ckpt.cli import app as cli

class Alarm(BaseException):
    pass

def on_alarm(*_):
    raise Alarm()

signal.signal(signal.SIGALRM, on_alarm)
cases = json.loads(sys.stdin.read())
import tiered_ckpt.tiers.backends, tiered_ckpt.tiers.blob, tiered_ckpt.lifecycle.status  # noqa: E401 - warm imports
for case in cases:
    out, err = io.StringIO(), io.StringIO()
    res = {"id": case["id"]}
    signal.alarm(case["alarm"])
    t0 = time.monotonic()
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            res["rc"] = cli.main(case["argv"])
    except Alarm:
        res["rc"] = "hang"
    except SystemExit as e:
        res["rc"] = e.code
    except BaseException:
        res["rc"] = "raised"
        err.write(traceback.format_exc())
    finally:
        signal.alarm(0)
    res["out"], res["err"] = out.getvalue()[-2000:], err.getvalue()[-2000:]
    res["s"] = round(time.monotonic() - t0, 2)
    print(json.dumps(res), flush=True)
"""


def _bad_configs(tmp: Path) -> dict[str, Path]:
    fifo = tmp / "fifo.yaml"
    os.mkfifo(fifo)
    bomb = tmp / "bomb.yaml"
    lines = ['a0: &a0 ["lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol"]']
    for i in range(1, 10):
        lines.append(f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 9)}]")
    bomb.write_text("\n".join(lines) + "\n")
    huge = tmp / "huge.yaml"
    huge.write_text("# " + "x" * (3 << 20) + "\n")
    return {"dev-zero": Path("/dev/zero"), "fifo": fifo, "alias-bomb": bomb, "huge": huge, "directory": tmp}


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    tmp = tmp_path_factory.mktemp("badinput")
    root = tmp / "root"
    root.mkdir()
    good = tmp / "good.yaml"
    good.write_text(f"root: {root}\nmodel: m\nbackend: local\n")
    cases: list[dict[str, Any]] = []
    for words, opts in COMMANDS:
        base = words.split()
        ctx = CONTEXT.get(base[0], [])
        for opt, dest in opts:
            extra = CONTEXT.get(f"{base[0]} {opt}", [])
            bad = _bad_configs_cached(tmp)
            for v in ([str(bad["fifo"]), str(tmp)] if dest in PATH_DESTS else VALUES):
                cases.append({"id": f"{words} {opt}={v}", "argv": [*base, "--config", str(good), *ctx, *extra,
                                                                    f"{opt}={v}"],
                              # A server or a watch that accepts the value runs until stopped: a short alarm.
                              "alarm": 3 if f"{base[0]} {opt}" in RUNS_UNTIL_STOPPED else ALARM,
                              "may_run": f"{base[0]} {opt}" in RUNS_UNTIL_STOPPED})
        for name, path in _bad_configs_cached(tmp).items():
            cases.append({"id": f"{words} --config={name}", "argv": [*base, "--config", str(path), *ctx],
                          "alarm": ALARM, "may_run": False})
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path), COLUMNS="200")
    env.pop("TIERED_CKPT_CONFIG", None)
    p = subprocess.run([sys.executable, "-c", CHILD], input=json.dumps(cases), capture_output=True, text=True,
                       timeout=900, env=env, cwd=tmp)
    got = {}
    for line in p.stdout.splitlines():
        if line.startswith('{"id"'):
            r = json.loads(line)
            got[r["id"]] = r
    for c in cases:
        got.setdefault(c["id"], {"rc": "child died", "out": "", "err": p.stderr[-3000:]})
        got[c["id"]]["may_run"] = c["may_run"]
    return got


_cached: dict[Path, dict[str, Path]] = {}


def _bad_configs_cached(tmp: Path) -> dict[str, Path]:
    if tmp not in _cached:
        _cached[tmp] = _bad_configs(tmp)
    return _cached[tmp]


@pytest.mark.timeout(900)
@pytest.mark.parametrize("command", [w for w, _ in COMMANDS])
def test_bad_values_and_bad_config_files_end_in_one_clear_message(results: dict[str, dict[str, Any]],
                                                                  command: str) -> None:
    bad = []
    for cid, r in results.items():
        if not (cid == command or cid.startswith(command + " -")):
            continue
        text = r["out"] + r["err"]
        if r["rc"] == "hang" and r["may_run"]:
            continue                   # a server or watch that accepted the value runs until stopped
        if r["rc"] in ("hang", "raised", "child died") or "Traceback" in text or "internal error" in text:
            bad.append(f"{cid}: rc={r['rc']}: {text[-600:]}")
        elif r["rc"] != 0 and "error" not in text and "health: " not in text:   # status: its report is the message
            bad.append(f"{cid}: rc={r['rc']} without a message")
    assert not bad, "\n".join(bad)
