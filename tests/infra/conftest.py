"""Helpers for the infrastructure tests: run the real program under Pulumi mocks (tiered_ops.mockrun)."""
from __future__ import annotations

from collections.abc import Callable

import pytest

from tiered_ops import mockrun

# A well-formed OpenSSH public key (the private half was never kept); public keys are not secrets.
SSH_KEY = "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIB3q0iP7c4k5o4S8m6Yt2m1pVdQ3xY9kq7f1mZl0aB2c ops@example"

Plan = Callable[..., mockrun.PreviewResult]


@pytest.fixture
def plan() -> Plan:
    """plan(stack, key=value, ...) -> a fresh run of __main__.py under mocks with those overrides."""

    def run(stack: str, **overrides: object) -> mockrun.PreviewResult:
        sets = {"sshPublicKey": SSH_KEY, **{k: str(v).lower() if isinstance(v, bool) else str(v) for k, v in overrides.items()}}
        return mockrun.run(stack, sets, preview_placeholders=False)

    return run
