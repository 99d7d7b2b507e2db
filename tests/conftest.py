"""Shared fixtures (a real Azurite for the whole session, a fresh container per test) and the markers
`make unit` deselects, applied here in one place so a test module needs no marker of its own:

* cluster: everything under tests/cluster (real munged, slurmctld, slurmd);
* network: a test that uses a local server through a fixture (Azurite, the ARM double);
* benchmark: a test of benchmarks/;
* slow: a test that spawns torch.distributed (gloo) ranks or CLI/Python subprocesses (SLOW below).
"""
from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from tiered_demo.azurite import Azurite

TESTS = Path(__file__).resolve().parent

# Fixtures that start or reach a local server.
NETWORK_FIXTURES = frozenset({"azurite", "azurite_container", "arm_double", "arm_env", "arm_jobs", "arm_tls"})

# Test modules that exercise benchmarks/.
BENCHMARK = frozenset({
    "toolkit/test_async_bench.py", "toolkit/test_bench_isolation.py", "toolkit/test_bench_smoke.py",
    "toolkit/test_bench_runner.py", "toolkit/test_dcp_bench.py",
})

# Test modules (or single node ids) that spawn gloo ranks or CLI/Python subprocesses: seconds each.
SLOW = frozenset({
    "demo/test_demo.py", "demo/test_timeline_script.py",
    "infra/test_infra_cloud_init.py::test_a_node_venv_from_the_tarball_runs_the_toolkit_without_the_demo_libraries",
    "infra/test_infra_cluster.py::test_no_secret_value_in_custom_data_outputs_or_plan_output",
    "infra/test_infra_preview.py", "infra/test_infra_python_floor.py",
    "infra/test_infra_settings.py::test_plan_script_prints_one_line_and_exits_2_without_traceback",
    "lifecycle/test_restore_races.py", "lifecycle/test_timeline.py",
    "teardown/test_teardown.py",
    "toolkit/test_claim_paths.py", "toolkit/test_cli_habits.py", "toolkit/test_cli_io.py", "toolkit/test_config_errors.py",
    "toolkit/test_config_rules.py", "toolkit/test_dcp.py", "toolkit/test_dcp_async.py",
    "toolkit/test_dcp_faults.py", "toolkit/test_dcp_interop.py", "toolkit/test_dcp_parity.py",
    "toolkit/test_dcp_plan_cache.py", "toolkit/test_dcp_ranks.py", "toolkit/test_dcp_read_paths.py",
    "toolkit/test_hostile_files.py", "toolkit/test_lightning.py", "toolkit/test_lightning_fsdp.py",
    "toolkit/test_memory_tier.py", "toolkit/test_multirank.py",
    "toolkit/test_packaging.py", "toolkit/test_redaction.py", "toolkit/test_replicated.py",
    "toolkit/test_resume_tiers.py", "toolkit/test_reused_save_id.py", "toolkit/test_sigkill.py", "toolkit/test_torch_dist.py", "toolkit/test_training_state.py",
    "toolkit/test_writer_ranks.py", "toolkit/test_writer_safety.py",
})


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    stale = sorted(e for e in SLOW | BENCHMARK if not (TESTS / e.split("::")[0]).is_file())
    if stale:
        raise pytest.UsageError(f"tests/conftest.py lists test modules that do not exist: {stale}")
    for item in items:
        try:
            rel = item.path.resolve().relative_to(TESTS).as_posix()
        except ValueError:
            continue
        name = rel + "::" + item.name.split("[")[0]
        if rel.startswith("cluster/"):
            item.add_marker(pytest.mark.cluster)
        if NETWORK_FIXTURES.intersection(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.network)
        if rel in BENCHMARK:
            item.add_marker(pytest.mark.benchmark)
        if rel in SLOW or name in SLOW:
            item.add_marker(pytest.mark.slow)


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
