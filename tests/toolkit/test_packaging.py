"""The wheel a node or a training image installs: the node toolkit only, its pins, its console script.

Built from a copy of the tree (a build writes build/ and *.egg-info next to the sources) with the
build backend already installed (no network), then installed with --no-deps into a fresh venv
whose dependencies come from this environment (the training image's role) and used from outside
the repository: what `pip install tiered_ckpt-*.whl[torch]` gives a training job.
"""
from __future__ import annotations

import email.parser
import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[2]


def _clean_env() -> dict[str, str]:
    """No PYTHONPATH: nothing of the repository is importable except through the installed wheel."""
    return {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tmp = tmp_path_factory.mktemp("wheel")
    tree = tmp / "tree"
    tree.mkdir()
    shutil.copy2(REPO / "pyproject.toml", tree / "pyproject.toml")
    shutil.copytree(REPO / "src", tree / "src", ignore=shutil.ignore_patterns("__pycache__", "*.egg-info", "*.pyc"))
    p = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "--no-index",
                        "-w", str(tmp / "dist"), str(tree)], capture_output=True, text=True, timeout=300,
                       env=_clean_env(), cwd=tmp)
    assert p.returncode == 0, p.stderr[-3000:]
    (whl,) = (tmp / "dist").glob("tiered_ckpt-*.whl")
    return whl


def _metadata(whl: Path) -> tuple[list[str], Any, str]:
    with zipfile.ZipFile(whl) as z:
        names = z.namelist()
        info = next(n for n in names if n.endswith(".dist-info/METADATA"))
        meta = email.parser.Parser().parsestr(z.read(info).decode())
        eps = z.read(info.replace("METADATA", "entry_points.txt")).decode()
    return names, meta, eps


def test_the_wheel_holds_the_node_toolkit_only(wheel: Path) -> None:
    names, _, _ = _metadata(wheel)
    tops = {n.split("/", 1)[0] for n in names}
    assert tops == {"tiered_ckpt", wheel.name.split("-py3")[0] + ".dist-info"}, tops
    # every source file of the package is in it (nothing left behind by the package finder)
    want = {p.relative_to(REPO / "src").as_posix() for p in (REPO / "src" / "tiered_ckpt").rglob("*.py")}
    assert want <= set(names), sorted(want - set(names))[:5]


def test_requires_dist_and_extras_match_pyproject(wheel: Path) -> None:
    tomllib = pytest.importorskip("tomllib")     # Python >= 3.11
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    _, meta, eps = _metadata(wheel)
    from packaging.markers import Marker
    from packaging.requirements import Requirement

    def with_extra(line: str, extra: str) -> str:
        # an extra's own marker (tomli's python_version) is joined to the extra's, as the wheel writes it
        r = Requirement(line)
        r.marker = Marker(f'({r.marker}) and extra == "{extra}"' if r.marker else f'extra == "{extra}"')
        return str(r)

    req = meta.get_all("Requires-Dist") or []
    want = list(project["dependencies"]) + [with_extra(r, x) for x, rs in project["optional-dependencies"].items()
                                            for r in rs]
    assert sorted(str(Requirement(r)) for r in req) == sorted(str(Requirement(r)) for r in want)
    assert set(meta.get_all("Provides-Extra") or []) == set(project["optional-dependencies"])
    # Ranges, not pins: the wheel resolves beside a training image's numpy 1.26 and pydantic 2.9.
    runtime = {Requirement(r).name: Requirement(r).specifier for r in project["dependencies"]}
    assert not any(str(sp).startswith("==") for sp in runtime.values()), runtime
    assert runtime["pydantic"].contains("2.9.0") and not runtime["pydantic"].contains("3.0")
    numpy = next(Requirement(r) for r in project["optional-dependencies"]["torch"] if r.startswith("numpy"))
    assert numpy.specifier.contains("1.26.0") and numpy.specifier.contains("2.4.6")
    # the DCP path views tensor bytes through numpy; the Lightning plugin needs Lightning
    assert any(r.startswith("lightning") for r in project["optional-dependencies"]["lightning"])
    assert "tiered-ckpt[torch]" in project["optional-dependencies"]["lightning"]
    assert "tiered-ckpt = tiered_ckpt.cli.app:main" in eps
    assert eps.count("=") == 1, eps          # one console script: what a node gets


def test_installed_with_no_deps_it_works_outside_the_repository(wheel: Path, tmp_path: Path) -> None:
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", "--system-site-packages", str(venv)], check=True,
                   timeout=120)
    py = venv / "bin" / "python"
    # The dependencies (and torch) come from the enclosing environment, as from a training image: a
    # path line adds its site-packages without running its .pth files (so no editable checkout).
    site = Path(subprocess.check_output([str(py), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                                        text=True).strip())
    (site / "outer.pth").write_text(sysconfig.get_path("purelib") + "\n")
    p = subprocess.run([sys.executable, "-m", "pip", "--python", str(py), "install", "-q", "--no-deps", "--no-index",
                        str(wheel)], capture_output=True, text=True, timeout=300, env=_clean_env())
    assert p.returncode == 0, p.stderr[-3000:]
    elsewhere = tmp_path / "job"
    elsewhere.mkdir()

    def run(*argv: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(list(argv), capture_output=True, text=True, timeout=120, env=_clean_env(), cwd=elsewhere)

    h = run(str(venv / "bin" / "tiered-ckpt"), "--help")
    assert h.returncode == 0 and "tiered-ckpt" in h.stdout and "list" in h.stdout, h.stderr[-2000:]
    # tiered_ckpt.lightning imports tiered_ckpt.dcp, torch and lightning (lightning: the dev extra)
    code = ("import tiered_ckpt, tiered_ckpt.lightning, importlib.util; print(tiered_ckpt.__file__); "
            "print(importlib.util.find_spec('tiered_ops'), importlib.util.find_spec('tiered_demo'))")
    r = run(str(py), "-c", code)
    assert r.returncode == 0, r.stderr[-2000:]
    where, missing = r.stdout.splitlines()
    assert Path(where).is_relative_to(site) and not Path(where).is_relative_to(REPO)
    assert missing == "None None"
