"""components/ split by what it produces: each answer of docs/architecture.md's table is one path.
Every role definition and assignment is made in components/resources/identity.py; the node's NodeConfig
is built in components/node/config.py only; the pure packages never touch the Pulumi SDKs (the import
contracts in pyproject.toml keep the last; this keeps the first two, which no import rule can see)."""
from __future__ import annotations

import ast

from .conftest import ROOT

COMPONENTS = ROOT / "components"


def _calls(names: set[str], *, with_arguments: bool = False) -> dict[str, list[str]]:
    """components/ module -> the calls of `names` it makes (`x.Name(...)` or `Name(...)`; with_arguments:
    only calls that pass a value, so `RetentionConfig()` reading the defaults does not count)."""
    found: dict[str, list[str]] = {}
    for path in sorted(COMPONENTS.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Call):
                f = node.func
                name = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else ""
                if name in names and (node.args or node.keywords or not with_arguments):
                    found.setdefault(path.relative_to(ROOT).as_posix(), []).append(f"{name} (line {node.lineno})")
    return found


def test_every_role_definition_and_assignment_is_made_in_identity_py() -> None:
    made = _calls({"RoleAssignment", "RoleDefinition"})
    assert set(made) == {"components/resources/identity.py"}, made


def test_the_node_config_is_built_in_one_function() -> None:
    made = _calls({"NodeConfig", "ArchiveConfig", "AmlfsConfig", "RetentionConfig", "MemoryConfig"}, with_arguments=True)
    assert set(made) == {"components/node/config.py"}, made
    tree = ast.parse((COMPONENTS / "node" / "config.py").read_text())
    builders = {f.name for f in ast.walk(tree) if isinstance(f, ast.FunctionDef)
                and any(isinstance(c, ast.Call) and getattr(c.func, "id", "") == "NodeConfig" for c in ast.walk(f))}
    assert builders == {"node_config"}
