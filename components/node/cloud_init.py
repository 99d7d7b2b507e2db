"""VM custom data (pure): a #cloud-config that writes the boot's files and runs the role's bootstrap.

The boot itself lives in real files under scripts/ (bootstrap per role, the shared steps, health check,
Scheduled Events watcher, munge-key helper, systemd units), linted by shellcheck and executed by the tests
against an image double. This module only assembles cloud-config: write_files with those files' contents
(read from scripts/, unchanged) and the settings as an environment file (/etc/tiered-ckpt/boot.env), runcmd
invoking the bootstrap. No script text is generated or substituted here.

Nothing here talks to Azure; the Pulumi cluster component feeds resolved values in through
Output.all(...).apply. The custom data carries no secret: the toolkit is fetched from a private blob
with the node's managed identity (IMDS token), and its sha256 (components/node/toolkit.py) is checked before install.

Why the toolkit is not embedded: Azure limits custom data to 64 KiB; the toolkit's source will grow
to 150-250 KB, which even gzip+base64 would push over the limit.
"""
from __future__ import annotations

import base64
import shlex
from dataclasses import dataclass
from pathlib import Path

import yaml

from components.settings.schema import WORK_DIR
from tiered_ckpt import records
from tiered_ckpt.config import NodeConfig, dump

from . import node_lock, slurm_conf

CUSTOM_DATA_LIMIT = 65535   # bytes of decoded custom data Azure accepts
MOUNT = "/lustrefs"
VENV = "/opt/tiered-ckpt"
CONFIG_PATH = "/etc/tiered-ckpt/config.yaml"
UNIT = "tiered-ckpt-retention"
# fstab options: the AMLFS docs' client-connect/automount example (noatime, flock, _netdev,
# x-systemd.automount) plus nofail (systemd.mount(5)).
FSTAB_OPTIONS = "defaults,noatime,flock,_netdev,x-systemd.automount,nofail"
NODE_REQUIREMENTS = "/etc/tiered-ckpt/node-requirements.txt"
# The unprivileged system user the retention timer runs as, and the group that owns the checkpoint
# root (training users join it). Fixed ids: every node mounts the same file system, so the group
# must map to the same number everywhere (a dynamically allocated system id differs between nodes
# as soon as their package sets differ). Below 60000, Debian's globally reserved range.
SERVICE_USER = "tiered-ckpt"
SERVICE_ID = 2742
# The group of the training users (trainingGroup) and a training user we create (trainingUser other than
# the admin): fixed ids for the same reason as SERVICE_ID.
TRAINING_GID = 2743
TRAINING_UID = 2744
ROLE_NODE, ROLE_LOGIN, ROLE_BYO = "node", "login", "byo"
BOOTSTRAP = "/usr/local/sbin/tiered-ckpt-bootstrap"
BOOT_LIB = "/usr/local/lib/tiered-ckpt/boot-common.sh"    # scripts/lib/boot-common.sh (the bootstraps source it)
BOOT_ENV = "/etc/tiered-ckpt/boot.env"                    # the settings of the scripts on this VM
SLURMD_DEFAULTS = "/etc/tiered-ckpt/slurmd.default"      # installed as /etc/default/slurmd after the packages
CLEANUP_TOOL = "/usr/local/sbin/tiered-ckpt-slurm-cleanup"
HEALTHCHECK = "/usr/local/sbin/tiered-ckpt-healthcheck"
MUNGE_KEY_TOOL = "/usr/local/sbin/tiered-ckpt-munge-key"
EVENTS_TOOL = "/usr/local/sbin/tiered-ckpt-scheduled-events"
EVENTS_UNIT = "tiered-ckpt-scheduled-events"
NCCL_PROFILE = "/etc/profile.d/nccl.sh"   # examples/train.sbatch sources it (NCCL_ENV_FILE)
MUNGE_KEY = "/etc/munge/munge.key"
# IMDS: tokens for the VM's user-assigned identities without a stored secret, and Scheduled Events.
IMDS = "http://169.254.169.254"
# The boot's files in this repository (the layout: Pulumi.yaml, __main__.py, components, stacks, scripts, tests).
SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"
# Secure Boot of the VM as the deployment sets it, and the Lustre client path (scripts/lib/boot-common.sh:
# the signed kmod under Secure Boot, the image's DKMS client otherwise). The boot reads the real state with
# `mokutil --sb-state`; this value decides only where that cannot tell ("unknown" counts as on).
SECURE_BOOT_STATES = ("on", "off", "unknown")
LUSTRE_CLIENTS = ("auto", "kmod", "dkms")


@dataclass(frozen=True)
class SlurmInputs:
    """Slurm and munge on one VM. The munge key itself is never here: it lives in Key Vault only."""

    conf: slurm_conf.SlurmConfInputs
    vault_url: str          # https://<vault>.vault.azure.net
    secret_name: str        # the Key Vault secret holding the munge key (base64)
    vault_client_id: str    # the user-assigned identity that reads (nodes) or creates (login) it
    version: str = slurm_conf.SLURM_VERSION   # slurm-smd* package version, the same on every VM


@dataclass(frozen=True)
class NodeInputs:
    """Everything the VM receives; all plain values (resolved Outputs). The toolkit's settings are `config`
    (components/node/config.py builds it); the rest is what only the boot reads."""

    config: NodeConfig      # written as /etc/tiered-ckpt/config.yaml
    mgs_address: str
    schedule: str           # the retention timer's OnCalendar
    tools_url: str      # https://<tools account>.blob.core.windows.net/<container>/<blob>
    tools_sha256: str
    role: str = ROLE_NODE           # ROLE_NODE (ND node, slurmd), ROLE_LOGIN (slurmctld, retention), ROLE_BYO
    admin_user: str = "azureuser"
    training_user: str = "azureuser"
    training_group: str = "training"
    nccl_topo_file: str = ""        # ND nodes: the image's NCCL topology file; "" writes no NCCL profile
    gpus_per_node: int = 8          # the health check drains a node that shows fewer
    slurm: SlurmInputs | None = None
    secure_boot: str = "unknown"    # SECURE_BOOT_STATES: this VM's securityProfile
    lustre_client: str = "auto"     # LUSTRE_CLIENTS
    # components/settings/vm_security.py's VmSecurity.boot_env() for a VM of ours (it wins over the two fields above)
    security_env: tuple[tuple[str, str], ...] = ()

    @property
    def retention(self) -> bool:
        """Retention runs once per cluster: on the login node; never on an ND node (see ROLE_BYO)."""
        return self.role in (ROLE_LOGIN, ROLE_BYO)


# The memory tier's directory: in /dev/shm, the tmpfs every Linux node has (half its RAM by default,
# which `make plan` checks the memory tier against); the toolkit creates it on first use.
MEMORY_TIER_DIR = "/dev/shm/tiered-ckpt"


# ND v5 NCCL settings: what Microsoft's HPC image writes to /etc/nccl.conf for NDv5 (Azure/azhpc-images,
# customizations/ndv5.sh: NCCL_IB_PCI_RELAXED_ORDERING=1, NCCL_TOPO_FILE, NCCL_IGNORE_CPU_AFFINITY=1) plus
# the socket interface and device order of Azure's Megatron-on-Slurm examples (Azure/ai-infrastructure-on-azure:
# NCCL_SOCKET_IFNAME=eth0, CUDA_DEVICE_ORDER=PCI_BUS_ID, UCX_TLS=rc, UCX_NET_DEVICES=mlx5_ib0:1).
NCCL_ENV = (
    ("NCCL_IB_PCI_RELAXED_ORDERING", "1"),
    ("NCCL_IGNORE_CPU_AFFINITY", "1"),
    ("NCCL_SOCKET_IFNAME", "eth0"),
    ("CUDA_DEVICE_ORDER", "PCI_BUS_ID"),
    ("UCX_TLS", "rc"),
    ("UCX_NET_DEVICES", "mlx5_ib0:1"),
)
# The topology file of each ND family on the HPC images (Azure/azhpc-images, topology/).
NCCL_TOPO_FILES = {"v5": "/opt/microsoft/ndv5-topo.xml", "v4": "/opt/microsoft/ndv4-topo.xml"}


def nccl_topo_file(vm_size: str) -> str:
    """The image's NCCL topology file for an ND size ("" when we know none)."""
    for suffix, path in NCCL_TOPO_FILES.items():
        if vm_size.endswith("_" + suffix):
            return path
    return ""




def _script(name: str) -> str:
    return (SCRIPTS / name).read_text()


def _file(path: str, content: str, mode: str = "0644") -> dict[str, str]:
    return {"path": path, "permissions": mode, "owner": "root:root", "content": content}


def _packages(n: NodeInputs) -> list[str]:
    """The Slurm packages this VM installs (Microsoft's slurm-smd*, at one version)."""
    if n.slurm is None:
        return []
    return ["slurm-smd", "slurm-smd-client", "slurm-smd-slurmctld" if n.role == ROLE_LOGIN else "slurm-smd-slurmd"]


def boot_settings(n: NodeInputs) -> dict[str, str]:
    """Everything the scripts read from BOOT_ENV; plain strings."""
    if n.secure_boot not in SECURE_BOOT_STATES:
        raise ValueError(f"secure_boot must be one of {SECURE_BOOT_STATES}, got {n.secure_boot!r}")
    if n.lustre_client not in LUSTRE_CLIENTS:
        raise ValueError(f"lustre_client must be one of {LUSTRE_CLIENTS}, got {n.lustre_client!r}")
    cfg = n.config
    env = {
        "ROLE": n.role, "IMDS": IMDS, "MOUNT": MOUNT, "MGS": n.mgs_address, "FSTAB_OPTIONS": FSTAB_OPTIONS,
        "TIERED_SECURE_BOOT": {"on": "true", "off": "false"}.get(n.secure_boot, "unknown"),
        "TIERED_LUSTRE_CLIENT": n.lustre_client,
        "VENV": VENV, "NODE_REQUIREMENTS": NODE_REQUIREMENTS, "TOOLS_URL": n.tools_url, "TOOLS_SHA256": n.tools_sha256,
        "IDENTITY_CLIENT_ID": cfg.archive.managed_identity_client_id or "",
        "ADMIN_USER": n.admin_user, "TRAINING_USER": n.training_user, "TRAINING_GROUP": n.training_group,
        "TRAINING_UID": str(TRAINING_UID), "TRAINING_GID": str(TRAINING_GID),
        "SERVICE_USER": SERVICE_USER, "SERVICE_ID": str(SERVICE_ID), "WORK_DIR": WORK_DIR,
        "LUSTRE_ROOT": cfg.root, "MODEL": cfg.model, "RECORDS_DIR": str(records.records_dir(cfg.root, cfg.model)),
        "RETENTION": "1" if n.role == ROLE_LOGIN else "0",
        "RETENTION_ACTION": cfg.retention.action, "RETENTION_SCHEDULE": n.schedule,
        "GPUS_PER_NODE": str(n.gpus_per_node if n.role == ROLE_NODE else 0),
        "SLURM": "0",
        # With the memory tier on, the events watcher writes the job's memory.notice_file first.
        "MEMORY_NOTICE": cfg.memory.notice_file if cfg.memory.dir is not None and n.role == ROLE_NODE else "",
    }
    env.update(dict(n.security_env))
    if env["TIERED_LUSTRE_CLIENT"] not in LUSTRE_CLIENTS:
        raise ValueError(f"TIERED_LUSTRE_CLIENT must be one of {LUSTRE_CLIENTS}, got {env['TIERED_LUSTRE_CLIENT']!r}")
    if n.slurm is not None:
        c = n.slurm.conf
        env.update({
            "SLURM": "1", "SLURM_VERSION": n.slurm.version, "SLURM_PACKAGES": " ".join(_packages(n)), "SLURM_USER": c.slurm_user,
            "SLURM_UID": str(slurm_conf.SLURM_UID), "SLURM_GID": str(slurm_conf.SLURM_UID),
            "MUNGE_UID": str(slurm_conf.MUNGE_UID), "MUNGE_GID": str(slurm_conf.MUNGE_UID),
            "SLURM_STATE_DIR": c.state_dir, "SLURM_SPOOL_DIR": c.spool_dir, "SLURM_LOG_DIR": c.log_dir,
            "SLURMD_DEFAULTS": SLURMD_DEFAULTS, "MUNGE_KEY_TOOL": MUNGE_KEY_TOOL,
            "VAULT_URL": n.slurm.vault_url, "MUNGE_SECRET": n.slurm.secret_name, "VAULT_CLIENT_ID": n.slurm.vault_client_id,
        })
    for k, v in env.items():
        if "\n" in v or "\0" in v:
            raise ValueError(f"boot setting {k} holds a line break: {v!r}")
    return env


def render_boot_env(n: NodeInputs) -> str:
    """BOOT_ENV: one KEY='value' per line, shell-quoted (the scripts source it; nothing is substituted)."""
    return "# tiered-ckpt boot settings (components/node/cloud_init.py); read by scripts/*\n" + "".join(
        f"{k}={shlex.quote(v)}\n" for k, v in boot_settings(n).items())


def boot_facts(custom_data: str) -> dict[str, str]:
    """What a rendered #cloud-config's boot will install, for the plan: the Slurm packages and the Lustre
    client path (from its BOOT_ENV; {} for a document without one)."""
    doc = yaml.safe_load(custom_data) if custom_data.startswith("#cloud-config") else None
    text = next((f["content"] for f in (doc or {}).get("write_files", []) if f.get("path") == BOOT_ENV), "")
    env = {k: " ".join(shlex.split(v)) for k, _, v in (ln.partition("=") for ln in text.splitlines()) if k and not k.startswith("#")}
    if not env:
        return {}
    sb = {"true": "on", "false": "off"}.get(env.get("TIERED_SECURE_BOOT", ""), "unknown")
    client = env.get("TIERED_LUSTRE_CLIENT", "auto")
    if client == "auto":
        client = "dkms (image)" if sb == "off" else "signed kmod amlfs-lustre-client-<ver>=$(uname -r)"
    elif client == "dkms":
        client = "dkms (image)"
    slurm = ",".join(f"{p}={env['SLURM_VERSION']}" for p in env.get("SLURM_PACKAGES", "").split()) or "none"
    return {"secureBoot": sb, "lustreClient": client, "slurm": slurm}


def _retention_units() -> list[dict[str, str]]:
    return [_file(f"/etc/systemd/system/{UNIT}.{kind}", _script(f"systemd/{UNIT}.{kind}")) for kind in ("service", "timer")]


def _slurm_files(n: NodeInputs) -> list[dict[str, str]]:
    if n.slurm is None:
        return []
    conf = n.slurm.conf
    files = [
        _file("/etc/slurm/slurm.conf", slurm_conf.render_slurm_conf(conf)),
        _file("/etc/slurm/gres.conf", slurm_conf.render_gres_conf(conf)),
        _file("/etc/slurm/cgroup.conf", slurm_conf.render_cgroup_conf(conf)),
        _file("/etc/tmpfiles.d/tiered-ckpt-slurm.conf", f"d {conf.run_dir} 0755 {conf.slurm_user} {conf.slurm_user} -\n"),
        _file(MUNGE_KEY_TOOL, _script("munge-key.py"), "0755"),
        _file(EVENTS_TOOL, _script("scheduled-events.py"), "0755"),
        _file(f"/etc/systemd/system/{EVENTS_UNIT}.service", _script(f"systemd/{EVENTS_UNIT}.service")),
    ]
    if n.role == ROLE_NODE:
        files += [_file(HEALTHCHECK, _script("healthcheck.sh"), "0755"),
                  _file(SLURMD_DEFAULTS, slurm_conf.render_slurmd_defaults(conf))]
    else:
        files += [_file(CLEANUP_TOOL, _script("slurm-cleanup.sh"), "0755")]
        files += [_file(f"/etc/systemd/system/tiered-ckpt-slurm-cleanup.{k}", _script(f"systemd/tiered-ckpt-slurm-cleanup.{k}"))
                  for k in ("service", "timer")]
    return files


def _nccl_profile(n: NodeInputs) -> list[dict[str, str]]:
    if not n.nccl_topo_file:
        return []
    lines = [f"export NCCL_TOPO_FILE={n.nccl_topo_file}"] + [f"export {k}={v}" for k, v in NCCL_ENV]
    return [_file(NCCL_PROFILE, "# NCCL on ND InfiniBand nodes (tiered-ckpt; sbatch scripts source this file)\n"
                  + "\n".join(lines) + "\n")]


def files(n: NodeInputs) -> list[dict[str, str]]:
    """Every file the VM gets (cloud-init write_files entries), the bootstrap last."""
    out = [_file(CONFIG_PATH, dump(n.config)),
           _file(NODE_REQUIREMENTS, node_lock.LOCK.read_text()),
           _file(BOOT_ENV, render_boot_env(n)),
           _file(BOOT_LIB, _script("lib/boot-common.sh"))]
    out += (_retention_units() if n.retention else []) + _slurm_files(n) + _nccl_profile(n)
    out.append(_file(BOOTSTRAP, _script("bootstrap-login.sh" if n.role == ROLE_LOGIN else "bootstrap-node.sh"), "0755"))
    return out


PACKAGES = ["python3-venv", "curl", "gnupg", "acl", "psmisc"]


def render(n: NodeInputs) -> str:
    """The #cloud-config document (text, before base64)."""
    if n.role == ROLE_BYO:
        raise ValueError("bring-your-own nodes get bootstrap_script(), not custom data")
    doc = {
        "package_update": True,
        "packages": PACKAGES,
        "write_files": files(n),
        "runcmd": [[BOOTSTRAP]],
    }
    return "#cloud-config\n" + yaml.safe_dump(doc, sort_keys=False, width=1000)


def bootstrap_script(n: NodeInputs) -> str:
    """clusterMode none: one bash script for the nodes of an existing cluster (CycleCloud Slurm, AKS node
    image, ...), run as root on each: the same files and bootstrap the program's own VMs get."""
    if n.role != ROLE_BYO:
        raise ValueError("bootstrap_script is for role byo")
    parts = [f"""#!/bin/bash
# tiered-ckpt node bootstrap for a cluster you bring (clusterMode none), generated by `pulumi up`.
#
# Each node must: be in the stack's compute subnet (the storage firewall and the AMLFS NSG admit that
# subnet; see the stack output computeSubnetId), run Ubuntu 22.04/24.04, and carry the user-assigned
# identity of the stack output nodeIdentityId (client ID {n.config.archive.managed_identity_client_id}), e.g.
#   az vmss identity assign -g <cluster rg> -n <scale set> --identities <nodeIdentityId>
# Run as root on every node:    sudo bash tiered-ckpt-bootstrap.sh
# and on exactly ONE host (retention runs once per cluster, under its per-model lock):
#                               sudo bash tiered-ckpt-bootstrap.sh --retention
# (CycleCloud: the scheduler node; AKS: one node of one pool, or run `tiered-ckpt retention apply` as a CronJob.)
set -euo pipefail
apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q {' '.join(PACKAGES)}
"""]
    for i, f in enumerate(files(n)):
        marker = f"TIERED_CKPT_EOF_{i}"
        if marker in f["content"]:
            raise ValueError(f"{f['path']}: content holds the heredoc marker {marker}")
        parts.append(f"install -D -m {f['permissions']} /dev/stdin {f['path']} <<'{marker}'\n{f['content']}"
                     f"{'' if f['content'].endswith(chr(10)) else chr(10)}{marker}\n")
    parts.append(f'exec {BOOTSTRAP} "$@"\n')
    return "".join(parts)


def encode(text: str) -> str:
    """Base64 as ARM expects customData; refuses to exceed Azure's limit (the compute REST spec, osProfile
    customData: "The maximum length of the binary array is 65535 bytes", the decoded document)."""
    raw = text.encode()
    if len(raw) > CUSTOM_DATA_LIMIT:
        raise ValueError(f"custom data is {len(raw)} bytes, above Azure's {CUSTOM_DATA_LIMIT}-byte limit")
    return base64.b64encode(raw).decode()
