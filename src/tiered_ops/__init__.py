"""Operator side of tiered-ckpt: offline preview, teardown (+ its gate), the Pulumi CLI driver.

Runs on an operator's workstation or CI, from a checkout of this repository; never shipped to
a node (cloud-init ships src/tiered_ckpt only).
"""
from pathlib import Path

# The Pulumi project (Pulumi.yaml, __main__.py, stacks/) this package belongs to: src/tiered_ops/.. /..
PROJECT_ROOT = Path(__file__).resolve().parents[2]
