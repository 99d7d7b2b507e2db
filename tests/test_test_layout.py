"""Shared test helpers live in conftest.py or a helpers module: no test module imports another test
module (pytest would then collect and run the imported module's tests a second time under its name, and
moving or renaming a test file breaks tests elsewhere)."""
from __future__ import annotations

import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parent


def _imported_modules(path: Path) -> list[str]:
    """Every module `path` imports, as a dotted name relative to tests/ ("infra.test_x")."""
    package = path.parent.relative_to(TESTS).parts
    out: list[str] = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [a.name.removeprefix("tests.") for a in node.names if a.name.startswith("tests.")]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = list(package[: len(package) - (node.level - 1)])
                mod = ".".join([*base, *(node.module or "").split(".")]).strip(".")
            elif (node.module or "").startswith("tests."):
                mod = (node.module or "").removeprefix("tests.")
            else:
                continue
            # `from . import test_x` names the module in the import list
            out += [mod] + [f"{mod}.{a.name}".strip(".") for a in node.names]
    return out


def test_no_test_module_imports_another_test_module() -> None:
    offenders = [f"{p.relative_to(TESTS.parent)} imports {m}"
                 for p in sorted(TESTS.rglob("test_*.py"))
                 for m in _imported_modules(p) if m.split(".")[-1].startswith("test_")]
    assert not offenders, "move shared helpers to the package's conftest.py:\n" + "\n".join(offenders)
