"""Slurm configuration text (pure): slurm.conf, gres.conf and cgroup.conf for the login/controller VM and
the ND nodes. No Pulumi, no I/O; cloud-init writes what these functions return.

Interface (for the cloud-init renderer):

    i = SlurmConfInputs(cluster_name="tiered", controller_host="login", max_nodes=settings.node_count)
    files = {"/etc/slurm/slurm.conf": render_slurm_conf(i),
             "/etc/slurm/gres.conf": render_gres_conf(i),
             "/etc/slurm/cgroup.conf": render_cgroup_conf(i)}      # render_cgroup_conf is "" in test_mode
    node command line: slurmd_args(i)  ->  ["-Z", "--conf", "Gres=gpu:8 Feature=ndv5"]

The same three files go to the controller and to every node (or nodes fetch them from the controller:
`enable_configless` is set, so `slurmd --conf-server <controller_host>` also works).

Nodes join without editing slurm.conf when nodeCount changes: they are Slurm *dynamic nodes*
(https://slurm.schedmd.com/dynamic_nodes.html, "Starting in Slurm 22.05"). Each slurmd starts with
`-Z --conf "Gres=gpu:8 Feature=<feature>"`, registers itself, reports its own CPUs/sockets/memory
(what `slurmd -C` prints), and lands in the partition through a NodeSet that selects nodes by that
feature. What the page requires, and what this renders:
  * MaxNodeCount = the most nodes that may be active at once (we render nodeCount plus headroom so a
    scale-up by a few nodes needs no controller restart; raising nodeCount past it re-renders this file);
  * SelectType=select/cons_tres ("Dynamic nodes are only supported with cons_tres");
  * TreeWidth=65533: the 22.05 page says fanout through slurmds is not supported with dynamic nodes and
    TreeWidth must be disabled (65533). Later releases lifted that rule; 65533 stays valid there.

Versions: Debian bookworm ships 22.05.8 (the test runs it). Ubuntu 22.04 (the ubuntu-hpc 2204 image)
ships slurm-wlm 21.08, which has no `slurmd -Z`: install Slurm >= 22.05 on the image (Microsoft's
packages.microsoft.com "slurm-ubuntu-jammy" repository, which CycleCloud's Slurm installer uses, or
Ubuntu 24.04's 23.11). `slurm_version_supported()` tells cloud-init whether an installed version will do.
"""
from __future__ import annotations

from dataclasses import dataclass

# slurm.conf(5) "TreeWidth": 65533 is the largest value; dynamic_nodes.html (22.05) requires it.
TREE_WIDTH_NO_FANOUT = 65533
# Dynamic nodes appeared in 22.05 (dynamic_nodes.html, "Overview").
MIN_DYNAMIC_VERSION = (22, 5)
# slurm.conf(5) defaults for the two daemons' ports.
DEFAULT_CTLD_PORT = 6817
DEFAULT_SLURMD_PORT = 6818
# ND H100 v5 / H200 v5: 8 GPUs per VM (Azure docs, "ND H100 v5-series").
ND_GPUS_PER_NODE = 8
# Slurm on the VMs: Microsoft's slurm-smd* packages (packages.microsoft.com/repos/slurm-ubuntu-noble), at
# this one version on every VM; the version CycleCloud's installer supports (Azure/cyclecloud-slurm README,
# "Supported Slurm and PMIX versions": 25.05.2), as the Debian revision SchedMD's packaging gives it
# (SchedMD debian/changelog: "slurm-smd (25.05.2-1)").
SLURM_VERSION = "25.05.2-1"
# Fixed uid = gid of the slurm and munge users, CycleCloud's defaults (Azure/cyclecloud-slurm
# azure-slurm-install/install.py: slurm 11100, munge 11101): slurmd rejects RPCs from a SlurmUser uid that
# differs between hosts ("Security violation", the same README's "UID conflicts" section).
SLURM_UID = 11100
MUNGE_UID = 11101


@dataclass(frozen=True)
class SlurmConfInputs:
    """Everything slurm.conf needs; plain values only."""

    cluster_name: str
    controller_host: str                 # host name slurmctld runs on (SlurmctldHost)
    max_nodes: int                       # nodeCount of the stack; MaxNodeCount adds node_headroom
    controller_addr: str = ""            # optional address when controller_host does not resolve
    partition: str = "gpu"
    node_feature: str = "ndv5"           # the feature dynamic nodes register with; the NodeSet selects it
    gpus_per_node: int = ND_GPUS_PER_NODE  # 0: no GRES (CPU-only nodes, the local test)
    gpu_device_glob: str = "/dev/nvidia[0-7]"
    node_headroom: int = 4
    slurm_user: str = "slurm"
    state_dir: str = "/var/spool/slurmctld"
    spool_dir: str = "/var/spool/slurmd"
    log_dir: str = "/var/log/slurm"
    run_dir: str = "/run/slurm"
    ctld_port: int = DEFAULT_CTLD_PORT
    slurmd_port: int = DEFAULT_SLURMD_PORT
    munge_socket: str = ""               # empty: munge's default socket
    health_check_program: str = ""       # empty: no HealthCheckProgram
    health_check_interval_s: int = 300
    # How long a job gets between SIGTERM and SIGKILL on scancel/preemption (slurm.conf(5) KillWait).
    kill_wait_s: int = 90
    # cgroup-free plugins (proctrack/linuxproc, task/none): for hosts without a delegated cgroup tree,
    # such as the test container. Production nodes use cgroup confinement of GPUs, cores and memory.
    test_mode: bool = False


def slurm_version_supported(version: str) -> bool:
    """True when `version` (e.g. "22.05.8", "slurm-wlm 23.11.4") has dynamic nodes."""
    token = version.split()[-1]
    parts = token.split(".")
    try:
        major, minor = int(parts[0]), int(parts[1])
    except (IndexError, ValueError):
        return False
    return (major, minor) >= MIN_DYNAMIC_VERSION


def max_node_count(i: SlurmConfInputs) -> int:
    return i.max_nodes + i.node_headroom


def render_slurm_conf(i: SlurmConfInputs) -> str:
    """slurm.conf(5) for controller and nodes."""
    if i.max_nodes < 1:
        raise ValueError(f"max_nodes must be >= 1, got {i.max_nodes}")
    ctld = f"{i.controller_host}({i.controller_addr})" if i.controller_addr else i.controller_host
    lines = [
        f"ClusterName={i.cluster_name}",
        f"SlurmctldHost={ctld}",
        f"SlurmUser={i.slurm_user}",
        f"SlurmctldPort={i.ctld_port}",
        f"SlurmdPort={i.slurmd_port}",
        "AuthType=auth/munge",
        "CredType=cred/munge",
    ]
    if i.munge_socket:
        # slurm.conf(5) AuthInfo "socket=": a munged other than the system one (the test's).
        lines.append(f"AuthInfo=socket={i.munge_socket}")
    lines += [
        f"StateSaveLocation={i.state_dir}",
        f"SlurmdSpoolDir={i.spool_dir}",
        f"SlurmctldPidFile={i.run_dir}/slurmctld.pid",
        f"SlurmdPidFile={i.run_dir}/slurmd.pid",
        f"SlurmctldLogFile={i.log_dir}/slurmctld.log",
        f"SlurmdLogFile={i.log_dir}/slurmd.log",
        "SlurmctldDebug=info",
        "SlurmdDebug=info",
        # Dynamic nodes (dynamic_nodes.html, "Slurm Configuration").
        f"MaxNodeCount={max_node_count(i)}",
        "SelectType=select/cons_tres",
        "SelectTypeParameters=CR_Core_Memory" if not i.test_mode else "SelectTypeParameters=CR_Core",
        f"TreeWidth={TREE_WIDTH_NO_FANOUT}",
        # Nodes fetch this file from the controller with `slurmd --conf-server` if they have none.
        "SlurmctldParameters=enable_configless",
        # A node that comes back after a reboot/reimage with a valid config returns to service.
        "ReturnToService=2",
        "SchedulerType=sched/backfill",
        # Batch jobs are requeued when a node of theirs fails (slurm.conf(5) JobRequeue=1); a job opts
        # out with --no-requeue.
        "JobRequeue=1",
        f"KillWait={i.kill_wait_s}",
        "MpiDefault=none",
        "SwitchType=switch/none",
        "JobCompType=jobcomp/none",
        "AccountingStorageType=accounting_storage/none",
    ]
    if i.test_mode:
        lines += [
            "ProctrackType=proctrack/linuxproc",
            "TaskPlugin=task/none",
            "JobAcctGatherType=jobacct_gather/none",
        ]
    else:
        lines += [
            # cgroup confinement: a job sees only the GPUs, cores and memory it was given.
            "ProctrackType=proctrack/cgroup",
            "TaskPlugin=task/cgroup,task/affinity",
            "JobAcctGatherType=jobacct_gather/cgroup",
            # ND nodes are whole-node machines: no swap accounting surprises, one job per node by default.
        ]
    if i.gpus_per_node > 0:
        lines.append("GresTypes=gpu")
    if i.health_check_program:
        # slurm.conf(5) HealthCheckProgram: run on every slurmd at this interval; the program drains
        # its own node (scontrol update state=drain) when it finds a fault.
        lines += [
            f"HealthCheckProgram={i.health_check_program}",
            f"HealthCheckInterval={i.health_check_interval_s}",
            "HealthCheckNodeState=ANY",
        ]
    lines += [
        # slurm.conf(5) NODESET: the set of registered nodes carrying the feature; dynamic nodes that
        # register with it join the partition (dynamic_nodes.html, "Partition Assignment").
        f"NodeSet={i.partition}nodes Feature={i.node_feature}",
        f"PartitionName={i.partition} Nodes={i.partition}nodes Default=YES MaxTime=INFINITE State=UP"
        + (" OverSubscribe=EXCLUSIVE" if not i.test_mode else ""),
    ]
    return "\n".join(lines) + "\n"


def render_gres_conf(i: SlurmConfInputs) -> str:
    """gres.conf(5): the GPUs of an ND node ("" when nodes have no GPUs)."""
    if i.gpus_per_node <= 0:
        return ""
    # No NodeName=: the line applies to every node that reads this file (gres.conf(5)).
    return f"Name=gpu File={i.gpu_device_glob}\n"


def render_cgroup_conf(i: SlurmConfInputs) -> str:
    """cgroup.conf(5) for the cgroup plugins ("" in test_mode, which uses none)."""
    if i.test_mode:
        return ""
    return "\n".join([
        "ConstrainCores=yes",
        "ConstrainDevices=yes",
        "ConstrainRAMSpace=yes",
    ]) + "\n"


def node_conf(i: SlurmConfInputs) -> str:
    """The --conf string a dynamic slurmd registers with (slurmd(8) -Z/--conf)."""
    parts = []
    if i.gpus_per_node > 0:
        parts.append(f"Gres=gpu:{i.gpus_per_node}")
    parts.append(f"Feature={i.node_feature}")
    return " ".join(parts)


def slurmd_args(i: SlurmConfInputs) -> list[str]:
    """slurmd's arguments on an ND node: register dynamically with GRES and the partition's feature."""
    return ["-Z", "--conf", node_conf(i)]


def render_slurmd_defaults(i: SlurmConfInputs) -> str:
    """/etc/default/slurmd with slurmd_args(i) as SLURMD_OPTIONS.

    The packaged unit (Slurm 23.11+, SchedMD etc/slurmd.service.in) stays as it is: Type=notify,
    EnvironmentFile=-/etc/default/slurmd, ExecStart=slurmd --systemd $SLURMD_OPTIONS. systemd reads the
    single-quoted value whole and splits the unbraced $SLURMD_OPTIONS at whitespace, honouring the double
    quotes (systemd.service(5), "Command lines"), so --conf gets one argument.
    """
    words = []
    for a in slurmd_args(i):
        if any(c in a for c in "'\"\\$`"):
            raise ValueError(f"slurmd argument {a!r} holds a quote, backslash or $")
        words.append(f'"{a}"' if any(c.isspace() for c in a) else a)
    return f"# tiered-ckpt: a dynamic node (slurmd -Z) with its GRES and feature (components/node/slurm_conf.py)\nSLURMD_OPTIONS='{' '.join(words)}'\n"
