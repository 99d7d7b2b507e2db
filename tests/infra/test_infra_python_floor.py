"""requires-python says >=3.10: the operator program (`make plan`, `pulumi up`) and the toolkit must not
need more. vermin (what `make lint` runs) reads every module the way a 3.10 interpreter would import it."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# vermin has no __main__: run its console entry point with this interpreter.
VERMIN = [sys.executable, "-c", "import sys; from vermin import main; sys.exit(main())", "--target=3.10-", "--no-tips", "--violations", "--eval-annotations", "-q"]


def _project() -> dict:
    if sys.version_info >= (3, 11):
        import tomllib
    else:
        import tomli as tomllib
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


@pytest.mark.timeout(120)
def test_the_program_and_the_toolkit_import_on_python_3_10(tmp_path: Path) -> None:
    assert _project()["project"]["requires-python"] == ">=3.10"
    r = subprocess.run([*VERMIN, "src", "components", "__main__.py"], cwd=ROOT, capture_output=True, text=True, timeout=110)
    assert r.returncode == 0, r.stdout + r.stderr
    # The same check refuses what broke `make plan` on 3.10: a module-level stdlib import from 3.11.
    bad = tmp_path / "bad.py"
    bad.write_text("import tomllib\n")
    r = subprocess.run([*VERMIN, str(bad)], capture_output=True, text=True, timeout=60)
    assert r.returncode != 0 and "tomllib" in r.stdout


def test_the_310_fallback_parser_is_declared_where_the_program_is_installed() -> None:
    infra = _project()["project"]["optional-dependencies"]["infra"]
    assert any(d.startswith("tomli") and "python_version < '3.11'" in d for d in infra)   # the version: constraints.txt
