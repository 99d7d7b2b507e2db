"""Each module is imported under its own name, and each name from the module that defines it: the
commit protocol (io/commit.py) does not pass on the marker format's names (io/marker.py)."""
from __future__ import annotations

import ast
from pathlib import Path

from tiered_ckpt.io import commit

REPO = Path(__file__).resolve().parents[1]
TREES = ("src", "components", "tests", "benchmarks", "examples")


def _imports():
    for tree in TREES:
        for py in sorted((REPO / tree).rglob("*.py")):
            for node in ast.walk(ast.parse(py.read_text())):
                if isinstance(node, ast.ImportFrom):
                    yield py.relative_to(REPO), node


def test_no_module_is_imported_under_another_modules_name() -> None:
    # `commit as mf` (mf: the module's name before it became the commit protocol) sent readers
    # looking for a module that does not exist
    aliased = [f"{p}:{n.lineno}" for p, n in _imports() if n.module == "tiered_ckpt.io"
               for a in n.names if a.asname and a.asname != a.name]
    assert not aliased, aliased


def test_the_commit_module_passes_on_no_names_of_the_marker_module() -> None:
    borrowed = [f"{p}:{n.lineno} {a.name}" for p, n in _imports() if n.module == "tiered_ckpt.io.commit"
                for a in n.names if a.name not in commit.__all__]
    assert not borrowed, f"import these from tiered_ckpt.io.marker: {borrowed}"
