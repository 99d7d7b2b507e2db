"""Shared fixtures: a real Azurite for the whole session, a fresh container per test."""
from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest

from tiered_demo.azurite import Azurite


@pytest.fixture(scope="session")
def azurite() -> Iterator[Azurite]:
    server = Azurite()
    server.start()
    try:
        yield server
    finally:
        server.cleanup()


@pytest.fixture
def azurite_container(azurite: Azurite) -> Iterator[tuple[str, str]]:
    """(connection string, container name) of a new empty container on the session's Azurite."""
    from azure.storage.blob import BlobServiceClient

    name = "t" + uuid.uuid4().hex[:20]
    svc = BlobServiceClient.from_connection_string(azurite.connection_string)
    svc.create_container(name)
    try:
        yield azurite.connection_string, name
    finally:
        try:
            svc.delete_container(name)
        except Exception:
            pass


# The ARM double (tests/doubles/arm_double.py): arm_tls, arm_double, arm_jobs, arm_env.
from tests.doubles.arm_fixtures import arm_double, arm_env, arm_jobs, arm_tls  # noqa: E402,F401
