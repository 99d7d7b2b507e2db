"""Library code never renders: io, lifecycle and tiers import neither rich nor the CLI layer.

Progress and tables belong to the command line (tiered_ckpt.cli); library functions take a
progress callback. Checked in a fresh interpreter, so that nothing imported by another test
(or by pytest) can hide an import.
"""
from __future__ import annotations

import os
import subprocess
import sys

from tests.lifecycle.helpers import REPO

LIBRARY = ("tiered_ckpt.io", "tiered_ckpt.lifecycle", "tiered_ckpt.tiers")

CHECK = """
import importlib, pkgutil, sys
names = []
for pkg_name in sys.argv[1:]:
    pkg = importlib.import_module(pkg_name)
    names.append(pkg_name)
    for m in pkgutil.walk_packages(pkg.__path__, pkg_name + "."):
        importlib.import_module(m.name)
        names.append(m.name)
bad = sorted(n for n in sys.modules if n == "rich" or n.startswith(("rich.", "tiered_ckpt.cli")))
print("imported", len(names), "modules:", " ".join(names))
if bad:
    sys.exit("library modules pulled in: " + ", ".join(bad))
"""


def test_io_lifecycle_and_tiers_import_no_renderer() -> None:
    p = subprocess.run([sys.executable, "-c", CHECK, *LIBRARY], cwd=REPO, capture_output=True, text=True,
                       env={**os.environ, "PYTHONPATH": str(REPO / "src")}, timeout=120)
    assert p.returncode == 0, p.stderr + p.stdout
    # The walk found the modules it is meant to check (a wrong path would check nothing).
    assert "tiered_ckpt.lifecycle.restore" in p.stdout and "tiered_ckpt.lifecycle.policy" in p.stdout
    assert "tiered_ckpt.io.commit" in p.stdout and "tiered_ckpt.tiers.blob" in p.stdout
