"""The node venv's dependency lock: every wheel pip may install on a node, pinned and hashed.

constraints.txt pins the toolkit's direct dependencies (the one place versions live; pyproject.toml
declares their ranges); this lock adds
their transitive closure and the sha256 of each wheel, so the bootstrap runs pip in hash-checking
mode (`pip install --require-hashes`, pip's "Secure installs" docs): a tampered or substituted wheel
on the index fails the install, as the toolkit tarball's own sha256 check does.

Regenerate after changing a pin (it downloads from PyPI; the committed file is what nodes use):

    python -m components.node.node_lock

Wheels only (--only-binary=:all:): a node never builds an sdist, and a build would fetch its build
requirements unhashed. The releases a node may run fix the Python versions (Ubuntu 22.04: 3.10,
Debian 12: 3.11, Ubuntu 24.04 = the Ubuntu-HPC image's release: 3.12); a package whose resolved
version differs between them gets a PEP 508 python_version marker.
"""
from __future__ import annotations

import hashlib
import re
import subprocess
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

if sys.version_info >= (3, 11):
    import tomllib
else:                           # Python 3.10 (requires-python >= 3.10): tomllib is the stdlib copy of tomli
    import tomli as tomllib

REPO = Path(__file__).resolve().parents[2]
LOCK = Path(__file__).resolve().parent / "node-requirements.txt"
CONSTRAINTS = REPO / "constraints.txt"      # the project's lock: exact versions of every direct dependency
PYTHONS = ("3.10", "3.11", "3.12")
# manylinux tags the x86_64 ND/login images satisfy (glibc 2.35 on 22.04, 2.39 on 24.04).
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64", "manylinux1_x86_64",
             "manylinux_2_5_x86_64")
# Installed into the venv too: pip itself (no unhashed self-upgrade), and the toolkit's build backend
# (pyproject [build-system]), so the toolkit installs with --no-build-isolation and fetches nothing.
TOOLING = ("pip", "setuptools", "wheel")
_REQ = re.compile(r"^([A-Za-z0-9_.-]+)==([^\s;\\]+)")


def normalize(name: str) -> str:
    """PEP 503 name normalization."""
    return re.sub(r"[-_.]+", "-", name).lower()


def pyproject_pins(pyproject: Path = REPO / "pyproject.toml", constraints: Path = CONSTRAINTS) -> dict[str, str]:
    """The toolkit's runtime dependencies ([project] dependencies, declared as ranges) at the exact
    versions the project's lock pins (constraints.txt), normalized name -> version. ValueError when
    one has no pin there or its pin is outside the declared range."""
    from packaging.requirements import Requirement

    deps = [Requirement(d) for d in tomllib.loads(pyproject.read_text())["project"]["dependencies"]]
    locked: dict[str, str] = {}
    for line in constraints.read_text().splitlines():
        m = _REQ.match(line.strip())
        if m:
            locked[normalize(m.group(1))] = m.group(2)
    pins: dict[str, str] = {}
    for r in deps:
        n = normalize(r.name)
        if n not in locked:
            raise ValueError(f"pyproject.toml dependency {str(r)!r} is not pinned with == in {constraints.name}")
        if not r.specifier.contains(locked[n], prereleases=True):
            raise ValueError(f"{constraints.name} pins {n}=={locked[n]}, outside pyproject.toml's range {str(r)!r}")
        pins[n] = locked[n]
    return pins


def lock_pins(lock: Path = LOCK) -> dict[str, set[str]]:
    """normalized name -> the versions the lock holds (one per python_version marker)."""
    out: dict[str, set[str]] = defaultdict(set)
    for line in lock.read_text().splitlines():
        m = _REQ.match(line)
        if m:
            out[normalize(m.group(1))].add(m.group(2))
    return dict(out)


def _wheel_name_version(path: Path) -> tuple[str, str]:
    name, version = path.name.split("-")[:2]   # wheel file names: {name}-{version}-... (PEP 427)
    return normalize(name), version


def _marker(pys: list[str], versions: dict[str, dict[str, set[str]]]) -> str:
    """A python_version range from the lowest Python that resolved this version up to the next Python
    that resolved another one (so a Python between two locked ones, e.g. 3.11, still matches one line)."""
    starts = sorted((min(ps, key=_vkey), v) for v, ps in versions.items())
    starts.sort(key=lambda t: _vkey(t[0]))
    lo = min(pys, key=_vkey)
    i = [s for s, _ in starts].index(lo)
    parts = [] if i == 0 else [f'python_version >= "{lo}"']
    if i + 1 < len(starts):
        parts.append(f'python_version < "{starts[i + 1][0]}"')
    return " and ".join(parts)


def _vkey(v: str) -> tuple[int, ...]:
    return tuple(int(x) for x in v.split("."))


def render_lock(found: dict[str, dict[str, dict[str, set[str]]]]) -> str:
    """found: name -> version -> python -> sha256s."""
    lines = ["# The node venv's wheels, pinned and hashed (pip install --require-hashes).",
             "# Generated by `python -m components.node.node_lock` from pyproject.toml's pins; do not edit."]
    for name in sorted(found):
        versions = found[name]
        for version in sorted(versions):
            pys = sorted(versions[version])
            marker = "" if len(versions) == 1 else " ; " + _marker(pys, versions)
            hashes = sorted({h for p in pys for h in versions[version][p]})
            lines.append(f"{name}=={version}{marker} \\")
            lines += [f"    --hash=sha256:{h}" + (" \\" if i < len(hashes) - 1 else "") for i, h in enumerate(hashes)]
    return "\n".join(lines) + "\n"


def generate(pip: list[str] | None = None) -> str:
    """Resolve and download (PyPI) for every node Python; the lock's text."""
    pip = pip or [sys.executable, "-m", "pip"]
    reqs = [f"{n}=={v}" for n, v in pyproject_pins().items()] + list(TOOLING)
    found: dict[str, dict[str, dict[str, set[str]]]] = defaultdict(lambda: defaultdict(lambda: defaultdict(set)))
    with tempfile.TemporaryDirectory() as tmp:
        for py in PYTHONS:
            d = Path(tmp) / py
            plat = [a for p in PLATFORMS for a in ("--platform", p)]
            subprocess.run([*pip, "download", "-q", "--only-binary=:all:", *plat, "--python-version", py,
                            "--implementation", "cp", "-d", str(d), *reqs], check=True)
            for whl in sorted(d.glob("*.whl")):
                name, version = _wheel_name_version(whl)
                found[name][version][py].add(hashlib.sha256(whl.read_bytes()).hexdigest())
    return render_lock(found)


def main() -> None:
    LOCK.write_text(generate())
    print(f"wrote {LOCK}")


if __name__ == "__main__":
    main()
