"""Fixtures of the cluster tests: a real local Slurm (tests/cluster/slurm.py)."""
from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.cluster.slurm import LocalSlurm, missing_binaries


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "slurm: runs a real munged/slurmctld/slurmd on this machine (-m slurm)")
    config.addinivalue_line("markers", "requeue: timing-bound Slurm requeue test, outside `make test` (make test-requeue)")


@pytest.fixture(scope="module")
def slurm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalSlurm]:
    missing = missing_binaries()
    if missing:
        pytest.skip(f"Slurm/munge not installed ({', '.join(missing)} missing); `make debs` installs slurm-wlm and munge")
    if os.geteuid() != 0:
        pytest.skip("the cluster tests start slurmd, which runs as root (slurmd(8)); run them as root")
    cluster = LocalSlurm(Path(tmp_path_factory.mktemp("slurm"))).start()
    try:
        yield cluster
    finally:
        cluster.stop()
