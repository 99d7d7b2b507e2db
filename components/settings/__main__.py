"""`python -m components.settings --pulumi-yaml`: rewrite Pulumi.yaml's config block from the schema."""
from __future__ import annotations

import sys
from pathlib import Path

from .schema import pulumi_yaml

if sys.argv[1:] != ["--pulumi-yaml"]:
    sys.exit("usage: python -m components.settings --pulumi-yaml   (rewrites Pulumi.yaml's config block)")
target = Path(__file__).resolve().parents[2] / "Pulumi.yaml"
target.write_text(pulumi_yaml(target.read_text()))
print(f"wrote {target}")
