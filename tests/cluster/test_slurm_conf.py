"""The rendered Slurm configuration: the parts a GPU cluster depends on (the daemons parsing it is
asserted by tests/cluster/test_slurm_job.py, which starts real ones from this text)."""
from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

from components.node.slurm_conf import (
    TREE_WIDTH_NO_FANOUT,
    SlurmConfInputs,
    max_node_count,
    render_cgroup_conf,
    render_gres_conf,
    render_slurm_conf,
    render_slurmd_defaults,
    slurm_version_supported,
    slurmd_args,
)
from tests.cluster.slurm import LocalSlurm, missing_binaries
from tests.doubles.image import systemd


def _prod(**kw: object) -> SlurmConfInputs:
    base: dict[str, object] = dict(cluster_name="tiered", controller_host="login", max_nodes=4,
                                   health_check_program="/usr/local/sbin/tiered-health")
    base.update(kw)
    return SlurmConfInputs(**base)  # type: ignore[arg-type]


def _pairs(text: str) -> list[tuple[str, str]]:
    """slurm.conf(5) lines as (key, rest): one `Key=value` setting, or a NodeSet/Partition line."""
    out = []
    for line in text.splitlines():
        assert line and not line.startswith(" "), f"blank or indented line: {line!r}"
        key, _, rest = line.partition("=")
        assert rest, f"not Key=value: {line!r}"
        out.append((key, rest))
    return out


def test_each_setting_once_and_gpu_partition() -> None:
    text = render_slurm_conf(_prod())
    pairs = _pairs(text)
    keys = [k for k, _ in pairs]
    assert len(keys) == len(set(keys)), "a setting appears twice; slurmctld would keep only one"
    d = dict(pairs)
    # Dynamic nodes: the three requirements of dynamic_nodes.html.
    assert d["SelectType"] == "select/cons_tres"
    assert int(d["MaxNodeCount"]) == max_node_count(_prod()) >= 4
    assert int(d["TreeWidth"]) == TREE_WIDTH_NO_FANOUT
    assert d["GresTypes"] == "gpu"
    assert d["NodeSet"] == "gpunodes Feature=ndv5"
    assert d["PartitionName"].startswith("gpu Nodes=gpunodes Default=YES")
    assert d["HealthCheckProgram"] == "/usr/local/sbin/tiered-health"
    assert d["ProctrackType"] == "proctrack/cgroup"
    assert d["JobRequeue"] == "1"
    # No static NodeName line: nodes join by registering, so nodeCount changes need no edit here.
    assert "NodeName" not in keys


def test_node_count_change_only_moves_max_node_count() -> None:
    a = render_slurm_conf(_prod(max_nodes=2)).splitlines()
    b = render_slurm_conf(_prod(max_nodes=64)).splitlines()
    diff = [(x, y) for x, y in zip(a, b, strict=True) if x != y]
    assert [x.split("=")[0] for x, _ in diff] == ["MaxNodeCount"]


def test_dynamic_slurmd_registers_gres_and_feature() -> None:
    assert slurmd_args(_prod()) == ["-Z", "--conf", "Gres=gpu:8 Feature=ndv5"]
    assert render_gres_conf(_prod()) == "Name=gpu File=/dev/nvidia[0-7]\n"
    assert "ConstrainDevices=yes" in render_cgroup_conf(_prod())


def test_test_mode_is_cgroup_free_and_cpu_only() -> None:
    i = _prod(test_mode=True, gpus_per_node=0, munge_socket="/tmp/x/sock")
    d = dict(_pairs(render_slurm_conf(i)))
    assert d["ProctrackType"] == "proctrack/linuxproc"
    assert d["TaskPlugin"] == "task/none"
    assert "GresTypes" not in d
    assert d["AuthInfo"] == "socket=/tmp/x/sock"
    assert render_gres_conf(i) == "" and render_cgroup_conf(i) == ""
    assert slurmd_args(i) == ["-Z", "--conf", "Feature=ndv5"]


def test_bad_node_count_refused() -> None:
    with pytest.raises(ValueError, match="max_nodes"):
        render_slurm_conf(_prod(max_nodes=0))


@pytest.mark.parametrize(("version", "ok"), [
    ("slurm-wlm 22.05.8", True), ("23.11.4", True), ("24.05.0", True),
    ("slurm-wlm 21.08.5", False), ("garbage", False),
])
def test_version_gate(version: str, ok: bool) -> None:
    assert slurm_version_supported(version) is ok


@pytest.mark.slurm
def test_controller_accepts_the_nd_configuration_and_gpu_nodes_join_the_partition(tmp_path: Path) -> None:
    """slurmctld parses the production (ND) files, and a node registered with the feature and 8 GPUs
    lands in the GPU partition with its GRES, without any NodeName line in slurm.conf."""
    missing = missing_binaries()
    if missing or os.geteuid() != 0:
        pytest.skip(f"needs root and Slurm/munge ({', '.join(missing) or 'not root'}); `make debs` installs them")
    cluster = LocalSlurm(tmp_path, production=True).start()
    try:
        conf = cluster.run("scontrol", "show", "config").stdout
        assert re.search(r"^MaxNodeCount\s*=\s*6$", conf, re.M), conf
        assert re.search(r"^ProctrackType\s*=\s*proctrack/cgroup$", conf, re.M), conf
        # What a dynamic slurmd -Z --conf "Gres=gpu:8 Feature=ndv5" registration creates (slurmd
        # itself needs GPUs and cgroups this machine lacks): the same node line, State=FUTURE.
        assert cluster.inputs is not None
        nd = cluster.slurmd_options()[2].split()
        cluster.run("scontrol", "create", "NodeName=nd-0001", "CPUs=96", "RealMemory=1000", *nd, "State=FUTURE")
        cluster.run("scontrol", "create", "NodeName=other-1", "CPUs=4", "Feature=cpu", "State=FUTURE")
        node = cluster.run("scontrol", "--future", "show", "node", "nd-0001").stdout
        assert "Gres=gpu:8" in node and re.search(r"Partitions=gpu\s*$", node, re.M), node
        other = cluster.run("scontrol", "--future", "show", "node", "other-1").stdout
        assert "other-1" in other and "Partitions=gpu" not in other, other
    finally:
        cluster.stop()


SCHEDMD_UNIT = Path(__file__).resolve().parents[1] / "doubles" / "image" / "units" / "slurmd.service.in"


def _install_unit(root: Path, text: str) -> None:
    (root / "lib/systemd/system").mkdir(parents=True)
    (root / "etc/default").mkdir(parents=True)
    (root / "lib/systemd/system/slurmd.service").write_text(text)
    (root / "etc/default/slurmd").write_text(render_slurmd_defaults(_prod()))


def test_the_packaged_notify_unit_runs_slurmd_with_systemd_and_the_dynamic_node_options(tmp_path: Path) -> None:
    """Slurm 23.11+'s unit (SchedMD etc/slurmd.service.in, kept in tests/doubles/image/units with its tag):
    Type=notify, `slurmd --systemd $SLURMD_OPTIONS`; the nodes' /etc/default/slurmd gives -Z and one --conf word."""
    text = SCHEDMD_UNIT.read_text()
    assert "Type=notify" in text and "ExecStart=@sbindir@/slurmd --systemd $SLURMD_OPTIONS" in text
    _install_unit(tmp_path, text.replace("@sbindir@", "/usr/sbin").replace("@SYSTEMD_TASKSMAX_OPTION@", ""))
    unit = systemd.load_unit(tmp_path, "slurmd.service")
    assert unit is not None and unit.service["Type"] == "notify"
    assert systemd.exec_start(tmp_path, unit) == ["/usr/sbin/slurmd", "--systemd", *slurmd_args(_prod())]


def test_debians_unit_reads_the_same_options(tmp_path: Path) -> None:
    """The real-Slurm tests run Debian bookworm's 22.05 (Type=simple, `slurmd -D -s $SLURMD_OPTIONS`): the
    same /etc/default/slurmd reaches it, so those tests start slurmd with the nodes' options."""
    deb = Path("/lib/systemd/system/slurmd.service")
    if not deb.exists():
        pytest.skip("Debian's slurmd package is not installed (`make debs`)")
    _install_unit(tmp_path, deb.read_text())
    unit = systemd.load_unit(tmp_path, "slurmd.service")
    assert unit is not None
    argv = systemd.exec_start(tmp_path, unit)
    assert argv[-3:] == slurmd_args(_prod()) and "--systemd" not in argv


def test_a_quote_in_the_node_options_is_refused() -> None:
    with pytest.raises(ValueError, match="quote"):
        render_slurmd_defaults(_prod(node_feature='nd"v5'))


@pytest.mark.slurm
def test_a_dynamic_slurmd_started_from_the_nodes_default_file_registers_with_its_feature(slurm: LocalSlurm) -> None:
    node = slurm.run("scontrol", "show", "node", slurm.node).stdout
    assert re.search(r"AvailableFeatures=ndv5\b", node) and "DYNAMIC" in node and "Partitions=gpu" in node, node
