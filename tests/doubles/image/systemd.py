"""What systemd does with a unit, as far as the image double needs it (systemd.unit(5), systemd.service(5),
systemd.exec(5)): unit files from /etc/systemd/system over /lib and /usr/lib, drop-ins in <unit>.d/*.conf
(an empty ExecStart= resets the list), EnvironmentFile= (a leading "-": optional; values may be quoted),
and ExecStart's "$VAR" expansion: an unbraced $VAR is split at whitespace with quotes honoured
("Command lines"), "${VAR}" stays one word. Also the fake root's passwd/group files.
"""
from __future__ import annotations

import shlex
from dataclasses import dataclass, field
from pathlib import Path

UNIT_DIRS = ("etc/systemd/system", "lib/systemd/system", "usr/lib/systemd/system")


@dataclass
class Unit:
    name: str
    unit: dict[str, str] = field(default_factory=dict)
    service: dict[str, str] = field(default_factory=dict)
    exec_start: list[str] = field(default_factory=list)
    env_files: list[str] = field(default_factory=list)
    timer: dict[str, list[str]] = field(default_factory=dict)


def unit_file(root: Path, name: str) -> Path | None:
    for d in UNIT_DIRS:
        if (root / d / name).is_file():
            return root / d / name
    return None


def _parse(text: str, u: Unit) -> None:
    section = ""
    for raw in text.splitlines():
        ln = raw.strip()
        if not ln or ln.startswith(("#", ";")):
            continue
        if ln.startswith("["):
            section = ln.strip("[]")
            continue
        key, _, value = ln.partition("=")
        if section == "Service" and key == "ExecStart":
            u.exec_start = [] if not value else u.exec_start + [value]
        elif section == "Service" and key == "EnvironmentFile":
            u.env_files = [] if not value else u.env_files + [value]
        elif section == "Service":
            u.service[key] = value
        elif section == "Timer":     # list settings: an empty assignment resets (systemd.timer(5))
            u.timer[key] = [] if not value else u.timer.get(key, []) + [value]
        elif section == "Unit":
            u.unit[key] = (u.unit.get(key, "") + " " + value).strip() if value else ""


def load_unit(root: Path, name: str) -> Unit | None:
    path = unit_file(root, name)
    if path is None:
        return None
    u = Unit(name)
    _parse(path.read_text(), u)
    for d in UNIT_DIRS:
        for drop in sorted((root / d / f"{name}.d").glob("*.conf")):
            _parse(drop.read_text(), u)
    return u


def parse_env_file(text: str) -> dict[str, str]:
    """KEY=VALUE lines; quotes removed as systemd's environment-file parser does (shell-like)."""
    env = {}
    for ln in text.splitlines():
        ln = ln.strip()
        if not ln or ln.startswith(("#", ";")) or "=" not in ln:
            continue
        key, _, value = ln.partition("=")
        words = shlex.split(value, comments=False)
        env[key.strip()] = " ".join(words) if len(words) != 1 else words[0]
    return env


def expand(command: str, env: dict[str, str]) -> list[str]:
    """ExecStart= command line -> argv (systemd.service(5) "Command lines")."""
    argv: list[str] = []
    for word in shlex.split(command):
        if word.startswith("${") and word.endswith("}"):
            argv.append(env.get(word[2:-1], ""))
        elif word.startswith("$") and word[1:].replace("_", "").isalnum():
            argv += shlex.split(env.get(word[1:], ""))
        else:
            argv.append(word)
    return argv


def exec_start(root: Path, u: Unit) -> list[str]:
    env: dict[str, str] = {}
    for f in u.env_files:
        optional, path = f.startswith("-"), f.lstrip("-")
        p = root / path.lstrip("/")
        if p.is_file():
            env.update(parse_env_file(p.read_text()))
        elif not optional:
            raise SystemExit(f"{u.name}: Failed to load environment files: {path}")
    if len(u.exec_start) != 1:
        raise SystemExit(f"{u.name}: has {len(u.exec_start)} ExecStart= lines; a service of this type needs one")
    return expand(u.exec_start[0], env)


def escape_path(path: str) -> str:
    """systemd-escape -p for a path of letters, digits, '-' and '/' (what the tests use)."""
    return path.strip("/").replace("-", "\\x2d").replace("/", "-") or "-"


def fstab_automounts(root: Path) -> list[str]:
    """systemd-fstab-generator(8): an x-systemd.automount entry gives <escaped path>.automount."""
    fstab = root / "etc/fstab"
    out = []
    for ln in fstab.read_text().splitlines() if fstab.exists() else []:
        f = ln.split()
        if len(f) >= 4 and not f[0].startswith("#") and "x-systemd.automount" in f[3].split(","):
            out.append(escape_path(f[1]) + ".automount")
    return out


def _entries(root: Path, db: str) -> list[list[str]]:
    p = root / "etc" / db
    return [ln.split(":") for ln in p.read_text().splitlines() if ln] if p.exists() else []


def user_entry(root: Path, name: str) -> str:
    return next((":".join(e) for e in _entries(root, "passwd") if e[0] == name or e[2] == name), "")


def group_entry(root: Path, name: str) -> str:
    return next((":".join(e) for e in _entries(root, "group") if e[0] == name or e[2] == name), "")


def ids(root: Path, db: str) -> list[int]:
    return [int(e[2]) for e in _entries(root, db)]


def add_line(path: Path, line: str) -> None:
    with open(path, "a") as f:
        f.write(line + "\n")
