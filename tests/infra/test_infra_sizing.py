"""Sizing model and AMLFS subnet table (pure)."""
from __future__ import annotations

import pytest

from components.settings import schema, sizing, subnets
from tiered_ops.mockrun import stack_config

from .conftest import SSH_KEY

pytestmark = pytest.mark.timeout(30)


def load(stack: str, **over: object) -> schema.Settings:
    return schema.load(stack_config(stack, {"sshPublicKey": SSH_KEY, **{k: str(v) for k, v in over.items()}}), stack)


def test_prod_reproduces_the_seed_numbers() -> None:
    z = sizing.compute(load("prod"))
    assert z.provisioned_gbps == pytest.approx(64.0)          # 500 MB/s/TiB x 128 TiB
    assert z.write_limited_by == "amlfs"                        # 8 nodes x 10 GB/s Ethernet = 80 GB/s > 64
    assert z.commit_seconds == pytest.approx(15.3, abs=0.1)     # 912 GiB at 64 GB/s
    assert z.archive_seconds == pytest.approx(130.6, abs=0.5)   # 912 GiB at 7.5 GB/s
    assert z.archive_keeps_up and z.capacity_ok
    assert z.nodes_to_fill_amlfs == 7


def test_commit_is_limited_by_node_ethernet_when_few_nodes() -> None:
    z = sizing.compute(load("prod", nodeCount=2))
    assert z.write_limited_by == "node ethernet"
    assert z.write_gbps == pytest.approx(20.0)
    assert z.commit_seconds == pytest.approx(912 * 2**30 / 20e9)


def test_archive_rate_is_configurable() -> None:
    z = sizing.compute(load("prod", dataMoverGBps="15"))
    assert z.archive_seconds == pytest.approx(912 * 2**30 / 15e9)


def test_interval_shorter_than_archive_is_refused_unless_allowed() -> None:
    with pytest.raises(schema.SettingsError, match=r"tiered:checkpointIntervalSeconds: 60 .*131 s.*allowArchiveBacklog"):
        load("prod", checkpointIntervalSeconds=60)
    z = sizing.compute(load("prod", checkpointIntervalSeconds=60, allowArchiveBacklog="true"))
    assert not z.archive_keeps_up
    assert z.resident_checkpoints == 3 + 3 + 1     # keep-last + ceil(130.6/60) un-archived + the one being written


def test_resident_set_must_fit_the_file_system() -> None:
    z = sizing.compute(load("dev"))
    assert z.resident_tib == pytest.approx(z.resident_checkpoints * 105 / 1024)
    with pytest.raises(schema.SettingsError, match=r"tiered:capacityTiB: 4 cannot hold the resident retention set"):
        load("dev", checkpointSizeGiB=1500, checkpointIntervalSeconds=3600)


def test_sizing_report_lines_name_the_numbers() -> None:
    lines = dict(sizing.report(sizing.compute(load("prod"))))
    assert lines["provisioned bandwidth"] == "64 GB/s"
    assert lines["commit one checkpoint"] == "912 GiB in 15.3 s"
    assert lines["archive one checkpoint"] == "130.6 s at 7.5 GB/s"


@pytest.mark.parametrize(("tib", "prefix"), [(4, 27), (16, 27), (20, 26), (40, 26), (44, 25), (92, 25), (96, 24), (128, 24), (196, 24), (200, 23), (400, 23), (768, 22)])
def test_amlfs_subnet_table(tib: int, prefix: int) -> None:
    assert subnets.required_prefix(tib) == prefix


def test_the_memory_tier_is_sized_against_the_nodes_ram() -> None:
    z = sizing.compute(load("prod", memoryKeep=2))
    assert z.memory_node_share_gib == pytest.approx(114.0)          # 912 GiB over 8 nodes
    assert z.memory_tmpfs_gib == pytest.approx(456.0)               # 2 kept x (own + the peer's replica)
    assert z.vm_ram_gib == 1900 and z.memory_fits                   # ND H100 v5: /dev/shm is half of it
    assert dict(sizing.report(z))["memory tier per node"].startswith("456 GiB tmpfs = 2 x 2 copies of a 114 GiB node share")
    assert dict(sizing.report(sizing.compute(load("prod"))))["memory tier per node"] == "off (tiered:memoryKeep 0)"
    with pytest.raises(schema.SettingsError, match=r"tiered:memoryKeep: 5 needs a 1140 GiB tmpfs per node .*1900 GiB"):
        load("prod", memoryKeep=5)


def test_the_node_config_carries_the_memory_tier_when_it_is_on() -> None:
    from components.node.config import node_config

    outputs = dict(account_url="https://a.blob.core.windows.net/", container="c", identity_client_id="id", subscription_id="s",
                   resource_group="g", filesystem="f", autoexport_job="j", provisioned_gbps=64.0)
    cfg = node_config(load("prod", memoryKeep=2), **outputs)
    assert (cfg.memory.dir, cfg.memory.keep, cfg.memory.budget_bytes) == ("/dev/shm/tiered-ckpt", 2, 456 << 30)
    off = node_config(load("prod"), **outputs)
    assert off.memory.dir is None
