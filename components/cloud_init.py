"""GPU node custom data (pure): a #cloud-config that mounts AMLFS, installs the toolkit, writes its config.

Nothing here talks to Azure; the Pulumi cluster component feeds resolved values in through
Output.all(...).apply. The custom data carries no secret: the toolkit is fetched from a private blob
with the node's managed identity (IMDS token), and its sha256 (below) is checked before install.

Why the toolkit is not embedded: Azure limits custom data to 64 KiB; the toolkit's source will grow
to 150-250 KB, which even gzip+base64 would push over the limit.
"""
from __future__ import annotations

import base64
import gzip
import hashlib
import io
import os
import tarfile
from dataclasses import dataclass
from pathlib import Path

import yaml

from tiered_ckpt.config import AmlfsConfig, ArchiveConfig, MemoryConfig, NodeConfig, RetentionConfig, dump, validate

from . import node_lock, slurm_conf

CUSTOM_DATA_LIMIT = 65535   # bytes of decoded custom data Azure accepts
MOUNT = "/lustrefs"
VENV = "/opt/tiered-ckpt"
CONFIG_PATH = "/etc/tiered-ckpt/config.yaml"
UNIT = "tiered-ckpt-retention"
# fstab options: the AMLFS docs' client-connect/automount example (noatime, flock, _netdev,
# x-systemd.automount) plus nofail (systemd.mount(5)).
FSTAB_OPTIONS = "defaults,noatime,flock,_netdev,x-systemd.automount,nofail"
MOUNT_UNIT = MOUNT.strip("/").replace("/", "-")   # systemd-escape -p, for a path without special characters
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
WORK_DIR = "work"          # /lustrefs/work: shared by the login VM and every node
SLURM_DIR = ".slurm"       # /lustrefs/.slurm: slurmctld's state (survives a replaced login VM)
BOOTSTRAP = "/usr/local/sbin/tiered-ckpt-bootstrap"
HEALTHCHECK = "/usr/local/sbin/tiered-ckpt-healthcheck"
MUNGE_KEY_TOOL = "/usr/local/sbin/tiered-ckpt-munge-key"
EVENTS_TOOL = "/usr/local/sbin/tiered-ckpt-scheduled-events"
EVENTS_UNIT = "tiered-ckpt-scheduled-events"
NCCL_PROFILE = "/etc/profile.d/nccl.sh"   # examples/train.sbatch sources it (NCCL_ENV_FILE)
MUNGE_KEY = "/etc/munge/munge.key"
# Key Vault REST API version of the secret GET/PUT calls (Key Vault REST reference, "Set Secret", "Get Secret").
KEYVAULT_API = "7.4"
# IMDS Scheduled Events (Azure docs, "Azure Metadata Service: Scheduled Events for Linux VMs").
SCHEDULED_EVENTS_URL = "http://169.254.169.254/metadata/scheduledevents?api-version=2020-07-01"
INSTANCE_NAME_URL = "http://169.254.169.254/metadata/instance/compute/name?api-version=2021-02-01&format=text"
# IMDS: the only way a node gets a token for its user-assigned identity without a stored secret.
IMDS_TOKEN = "http://169.254.169.254/metadata/identity/oauth2/token?api-version=2018-02-01&resource=https%3A%2F%2Fstorage.azure.com%2F"


@dataclass(frozen=True)
class Toolkit:
    path: Path          # the built tarball
    sha256: str
    blob_name: str


@dataclass(frozen=True)
class SlurmInputs:
    """Slurm and munge on one VM. The munge key itself is never here: it lives in Key Vault only."""

    conf: slurm_conf.SlurmConfInputs
    vault_url: str          # https://<vault>.vault.azure.net
    secret_name: str        # the Key Vault secret holding the munge key (base64)
    vault_client_id: str    # the user-assigned identity that reads (nodes) or creates (login) it


@dataclass(frozen=True)
class NodeInputs:
    """Everything the node needs; all plain values (resolved Outputs)."""

    mgs_address: str
    account_url: str
    data_container: str
    blob_prefix: str
    lustre_root: str
    model: str
    nodes: int
    identity_client_id: str
    subscription_id: str
    resource_group: str
    filesystem: str
    autoexport_job: str
    provisioned_gbps: float
    keep_last: int
    keep_every_steps: int
    min_keep: int
    action: str
    schedule: str
    tools_url: str      # https://<tools account>.blob.core.windows.net/<container>/<blob>
    tools_sha256: str
    memory_keep: int = 0            # the memory tier (0: off): copies per rank in node RAM
    memory_budget_bytes: int = 0    # bytes this node's memory tier may hold (keep x 2 x its share)
    role: str = ROLE_NODE           # ROLE_NODE (ND node, slurmd), ROLE_LOGIN (slurmctld, retention), ROLE_BYO
    admin_user: str = "azureuser"
    training_user: str = "azureuser"
    training_group: str = "training"
    nccl_topo_file: str = ""        # ND nodes: the image's NCCL topology file; "" writes no NCCL profile
    gpus_per_node: int = 8          # the health check drains a node that shows fewer
    slurm: SlurmInputs | None = None

    @property
    def retention(self) -> bool:
        """Retention runs once per cluster: on the login node; never on an ND node (see ROLE_BYO)."""
        return self.role in (ROLE_LOGIN, ROLE_BYO)


def build_toolkit(repo_root: Path, out_dir: Path) -> Toolkit:
    """A deterministic tar.gz of pyproject.toml + src/tiered_ckpt (same input -> same bytes -> same hash).

    Only the node toolkit: the operator (tiered_ops) and demo (tiered_demo) packages never reach a node.

    pip installs it on the node with the dependency pins of pyproject.toml, the one place they live.
    """
    members: list[tuple[str, Path]] = [("pyproject.toml", repo_root / "pyproject.toml")]
    pkg = repo_root / "src" / "tiered_ckpt"
    for p in sorted(pkg.rglob("*")):
        if p.is_file() and "__pycache__" not in p.parts and p.suffix in (".py", ".typed", ".yaml", ".json", ".txt"):
            members.append((f"src/tiered_ckpt/{p.relative_to(pkg).as_posix()}", p))
    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for name, path in members:
            data = path.read_bytes()
            info = tarfile.TarInfo(name)
            info.size, info.mtime, info.mode = len(data), 0, 0o644
            info.uid = info.gid = 0
            info.uname = info.gname = "root"
            tar.addfile(info, io.BytesIO(data))
    blob = gzip.compress(raw.getvalue(), compresslevel=9, mtime=0)
    sha = hashlib.sha256(blob).hexdigest()
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"tiered-ckpt-{sha[:16]}.tar.gz"
    if not path.exists() or path.read_bytes() != blob:
        tmp = path.with_suffix(".tmp")
        tmp.write_bytes(blob)
        os.replace(tmp, path)
    for old in out_dir.glob("tiered-ckpt-*.tar.gz"):
        if old != path:
            old.unlink(missing_ok=True)   # earlier builds; the Pulumi state keeps only their hashes
    return Toolkit(path=path, sha256=sha, blob_name=path.name)


# The memory tier's directory: in /dev/shm, the tmpfs every Linux node has (half its RAM by default,
# which `make plan` checks the memory tier against); the toolkit creates it on first use.
MEMORY_TIER_DIR = "/dev/shm/tiered-ckpt"


def node_config(n: NodeInputs) -> NodeConfig:
    """The toolkit's own config object, validated by the toolkit's own rules."""
    cfg = NodeConfig(
        root=n.lustre_root,
        model=n.model,
        backend="amlfs",
        nodes=n.nodes,
        archive=ArchiveConfig(account_url=n.account_url, container=n.data_container, prefix=n.blob_prefix,
                              managed_identity_client_id=n.identity_client_id),
        amlfs=AmlfsConfig(mount=MOUNT, subscription_id=n.subscription_id, resource_group=n.resource_group,
                          filesystem=n.filesystem, autoexport_job=n.autoexport_job, provisioned_gbps=n.provisioned_gbps),
        retention=RetentionConfig(keep_last=n.keep_last, keep_every_steps=n.keep_every_steps, min_keep=n.min_keep, action=n.action),
        memory=MemoryConfig() if not n.memory_keep else
        MemoryConfig(dir=MEMORY_TIER_DIR, keep=n.memory_keep, budget_bytes=n.memory_budget_bytes),
    )
    validate(cfg)
    return cfg


def _bootstrap(n: NodeInputs) -> str:
    # Runs once from runcmd. Idempotent, so a re-run after a failure (or reimage) converges.
    return _bootstrap_common(n) + _bootstrap_tree(n) + _bootstrap_slurm(n) + 'log "done"\n'


def _bootstrap_common(n: NodeInputs) -> str:
    return f"""#!/bin/bash
# tiered-ckpt {n.role} bootstrap (generated by the Pulumi program; see components/cloud_init.py)
set -euo pipefail
export DEBIAN_FRONTEND=noninteractive
log() {{ echo "tiered-ckpt-bootstrap: $*"; }}

# 1-2. Lustre client (Azure docs, "Install the Azure Managed Lustre client": prebuilt kmod or DKMS, never
#    both). Current Ubuntu-HPC images ship the DKMS client (amlfs-lustre-client-dkms-<version>), which
#    rebuilds the module for every kernel the image installs, so the kernel is not held. A node whose image
#    has no client gets the DKMS client too (the packages need this kernel's headers). Only an image that
#    ships a prebuilt kmod client (and no DKMS one) keeps it, with its kernel held: a kmod is built for one kernel.
dkms_pkg=$(dpkg-query -W -f='${{Package}} ${{db:Status-Abbrev}}\n' 'amlfs-lustre-client-dkms-*' 2>/dev/null | awk '$2 ~ /^ii/ {{print $1}}' | sort -rV | head -n1 || true)
if [ -n "$dkms_pkg" ]; then
  log "Lustre client: $dkms_pkg (DKMS, from the image)"
  modinfo lustre >/dev/null 2>&1 || dkms autoinstall || {{ log "DKMS could not build the Lustre module for kernel $(uname -r)"; exit 1; }}
elif modinfo lustre >/dev/null 2>&1; then
  log "Lustre client: prebuilt kmod from the image; holding kernel $(uname -r)"
  apt-mark hold linux-azure linux-image-azure linux-headers-azure "linux-image-$(uname -r)" "linux-headers-$(uname -r)" || true
else
  log "installing the AMLFS Lustre DKMS client for kernel $(uname -r)"
  . /etc/os-release
  curl -fsSL https://packages.microsoft.com/keys/microsoft.asc | gpg --dearmor --yes -o /usr/share/keyrings/microsoft-amlfs.gpg
  echo "deb [arch=amd64 signed-by=/usr/share/keyrings/microsoft-amlfs.gpg] https://packages.microsoft.com/repos/amlfs-${{VERSION_CODENAME}}/ ${{VERSION_CODENAME}} main" > /etc/apt/sources.list.d/amlfs.list
  apt-get update -q
  dkms_pkg=$(apt-cache search --names-only '^amlfs-lustre-client-dkms-' | awk '{{print $1}}' | sort -rV | head -n1)
  [ -n "$dkms_pkg" ] || {{ log "no amlfs-lustre-client-dkms package in the AMLFS repository for ${{VERSION_CODENAME}}"; exit 1; }}
  apt-get install -y -q "linux-headers-$(uname -r)" "$dkms_pkg"
fi
modprobe lustre || {{ log "the Lustre kernel module does not load on kernel $(uname -r)"; exit 1; }}

# 3. Mount AMLFS. fstab as the AMLFS docs' automount example: _netdev (a network file system),
#    x-systemd.automount (mounted on first access, so boot never waits for the MGS: systemd.mount(5)),
#    nofail (an unreachable file system never drops the VM into emergency mode; the health check drains it).
mkdir -p {MOUNT}
sed -i '\\| {MOUNT} lustre |d' /etc/fstab
echo '{n.mgs_address}@tcp:/lustrefs {MOUNT} lustre {FSTAB_OPTIONS} 0 0' >> /etc/fstab
systemctl daemon-reload      # systemd-fstab-generator(8) turns the entry into {MOUNT_UNIT}.automount
systemctl start {MOUNT_UNIT}.automount
for i in $(seq 1 30); do
  findmnt -n -t lustre {MOUNT} >/dev/null && break
  timeout 60 stat -t {MOUNT}/ >/dev/null 2>&1 || sleep 10     # the first access mounts it
done
findmnt -n -t lustre {MOUNT} >/dev/null || {{ log "could not mount {MOUNT} from {n.mgs_address}@tcp"; exit 1; }}

# 4. The toolkit: private blob, fetched with the node's managed identity, verified by sha256.
#    Role assignments can take minutes to propagate: retry for up to ~15 minutes.
#    The bearer token never appears on a command line (any user sees those in ps): python writes
#    the whole header line into a mode-0600 file (mktemp(1)) and curl reads it with -H @file.
fetch_toolkit() {{
  local tarball=$1 tries=${{2:-90}} hdr ok=0 i
  hdr=$(mktemp)
  for i in $(seq 1 "$tries"); do
    if curl -fsS -H Metadata:true "{IMDS_TOKEN}&client_id={n.identity_client_id}" \\
         | python3 -c 'import json,sys; print("Authorization: Bearer " + json.load(sys.stdin)["access_token"])' > "$hdr" \\
       && curl -fsS -o "$tarball" -H @"$hdr" -H "x-ms-version: 2021-08-06" "{n.tools_url}"; then
      if echo "{n.tools_sha256}  $tarball" | sha256sum -c --status; then ok=1; break; fi
      log "toolkit checksum mismatch; retrying"
    fi
    [ "$i" = "$tries" ] || sleep 10
  done
  rm -f "$hdr"
  [ "$ok" = 1 ]
}}
mkdir -p /var/lib/tiered-ckpt
fetch_toolkit /var/lib/tiered-ckpt/toolkit.tar.gz || {{ log "could not fetch the toolkit from {n.tools_url}"; exit 1; }}
tarball=/var/lib/tiered-ckpt/toolkit.tar.gz
rm -rf {VENV}/src && mkdir -p {VENV}/src
tar -xzf "$tarball" -C {VENV}/src
python3 -m venv {VENV}
# Dependencies in pip's hash-checking mode from the lock the program ships (components/node_lock.py):
# every wheel pinned and its sha256 checked, pip and the build backend included; then the toolkit
# itself (already sha256-checked above) with no dependency resolution, no index and no build isolation.
{VENV}/bin/pip install -q --require-hashes --only-binary=:all: -r {NODE_REQUIREMENTS}
{VENV}/bin/pip install -q --no-deps --no-index --no-build-isolation {VENV}/src
ln -sf {VENV}/bin/tiered-ckpt /usr/local/bin/tiered-ckpt
"""


def _bootstrap_tree(n: NodeInputs) -> str:
    g, svc = n.training_group, SERVICE_USER
    make_trainer = "" if n.training_user == n.admin_user else (
        f"getent passwd {n.training_user} >/dev/null || useradd --uid {TRAINING_UID} --gid {g} --create-home --shell /bin/bash {n.training_user}\n")
    timer = f"systemctl enable --now {UNIT}.timer\n" if n.retention else "# (not on this host)\n"
    if n.role == ROLE_BYO:
        timer = (f'if [ "$RETENTION" = 1 ]; then systemctl enable --now {UNIT}.timer; '
                 f'else systemctl disable --now {UNIT}.timer 2>/dev/null || true; fi\n')
    return f"""
# 5. Users and the checkpoint root. Training ranks (user {n.training_user}, group {g}) write checkpoints;
#    retention runs as the unprivileged system user {svc}, so a symlink or FIFO planted in the shared
#    tree can never redirect a root-owned delete or write. Both groups get rwx through the default ACL
#    (acl(5)): new checkpoint directories stay writable for every rank and for retention whatever the
#    job's umask. setgid (2775): new directories inherit the training group.
#    Fixed ids: every node mounts the same file system, so names must map to the same numbers everywhere.
getent group {svc} >/dev/null || groupadd --system --gid {SERVICE_ID} {svc}
getent passwd {svc} >/dev/null || useradd --system --uid {SERVICE_ID} --gid {svc} \\
  --no-create-home --home-dir /nonexistent --shell /usr/sbin/nologin {svc}
[ "$(getent group {svc} | cut -d: -f3)" = {SERVICE_ID} ] || {{ log "group {svc} exists with another gid than {SERVICE_ID}; every node must use the same"; exit 1; }}
getent group {g} >/dev/null || groupadd --gid {TRAINING_GID} {g}
[ "$(getent group {g} | cut -d: -f3)" = {TRAINING_GID} ] || {{ log "group {g} exists with another gid than {TRAINING_GID}; every node must use the same"; exit 1; }}
{make_trainer}for u in {n.training_user} {n.admin_user} {svc}; do getent passwd "$u" >/dev/null && usermod -aG {g} "$u"; done
mkdir -p {n.lustre_root}/{n.model}
# A shared working directory for job files and training virtualenvs: sbatch runs the script on the
# nodes from the submit directory, and home directories are per VM. Not under the checkpoint prefix,
# so auto-export never copies it.
install -d -g {g} -m 2775 {MOUNT}/{WORK_DIR}
for d in {n.lustre_root} {n.lustre_root}/{n.model}; do
  chown {n.training_user}:{g} "$d"
  chmod 2775 "$d"
  setfacl -m g:{g}:rwx,d:g:{g}:rwx,g:{svc}:rwx,d:g:{svc}:rwx "$d" || log "no ACL support on $d: training jobs must use umask 002"
done

# 6. Retention: once per cluster (the login node; in bring-your-own mode the one host given --retention).
systemctl daemon-reload
{timer}"""


def _bootstrap_slurm(n: NodeInputs) -> str:
    if n.slurm is None:
        return ""
    conf = n.slurm.conf
    if n.role == ROLE_LOGIN:
        daemon = f"""apt-get install -y -q munge slurmctld slurm-client
systemd-tmpfiles --create /etc/tmpfiles.d/tiered-ckpt-slurm.conf     # {conf.run_dir} now, not only from the next boot
{MUNGE_KEY_TOOL} init
systemctl restart munge
# slurmctld's state on Lustre: a replaced login VM picks up the queue where the old one left it.
install -d -o {conf.slurm_user} -g {conf.slurm_user} -m 0750 {conf.state_dir}
chown -R {conf.slurm_user}:{conf.slurm_user} {conf.state_dir}
install -d -o {conf.slurm_user} -g {conf.slurm_user} {conf.log_dir}
systemctl enable munge slurmctld
systemctl restart slurmctld
"""
    else:
        daemon = f"""apt-get install -y -q munge slurmd slurm-client
systemd-tmpfiles --create /etc/tmpfiles.d/tiered-ckpt-slurm.conf     # {conf.run_dir} now, not only from the next boot
{MUNGE_KEY_TOOL} fetch
systemctl restart munge
install -d -o root -g root {conf.log_dir} {conf.spool_dir}
systemctl daemon-reload
systemctl enable munge slurmd
systemctl restart slurmd
"""
    return f"""
# 7. Slurm. Ubuntu 24.04 ships Slurm 23.11, which has dynamic nodes (slurmd -Z, Slurm 22.05+): a node
#    registers itself with the controller, so changing nodeCount never edits slurm.conf. The munge key
#    comes from Key Vault with this VM's managed identity ({MUNGE_KEY_TOOL}); it is never in custom data.
export DEBIAN_FRONTEND=noninteractive
{daemon}systemctl enable --now {EVENTS_UNIT}.service
"""


SCRIPTS = Path(__file__).resolve().parent / "node_scripts"
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


def _retention_units(n: NodeInputs) -> list[dict[str, str]]:
    # Not root (systemd.exec(5) User=/Group=): retention deletes in a tree other users can write.
    # Lustre lets an unprivileged user ask only for HSM restores by default (the coordinator's
    # user/group/other request masks are RESTORE; lfs-hsm(1), the Lustre manual's HSM chapter),
    # and AMLFS does not expose those masks: `lfs hsm_release` needs CAP_SYS_ADMIN, so with
    # action "release" the service keeps that one capability (ambient, nothing else). No
    # capability bypasses file permissions (CAP_DAC_OVERRIDE, CAP_FOWNER are not granted).
    # journald gets one JSON object per log line on stderr (--log-format json: model, checkpoint,
    # operation, duration_s, bytes, outcome) and the run's result on stdout (--json). With
    # metrics.textfile set in the node config, each run also rewrites that node-exporter textfile
    # (its directory must be writable by the service user).
    caps = ("AmbientCapabilities=CAP_SYS_ADMIN\nCapabilityBoundingSet=CAP_SYS_ADMIN\n" if n.action == "release"
            else "AmbientCapabilities=\nCapabilityBoundingSet=\n")
    service = f"""[Unit]
Description=tiered-ckpt retention: free Lustre only for checkpoints proven archived
After=network-online.target remote-fs.target
Wants=network-online.target
RequiresMountsFor={MOUNT}

[Service]
Type=oneshot
User={SERVICE_USER}
Group={SERVICE_USER}
SupplementaryGroups={n.training_group}
UMask=0002
{caps}NoNewPrivileges=yes
ProtectSystem=full
ProtectHome=yes
PrivateTmp=yes
Environment=TIERED_CKPT_CONFIG={CONFIG_PATH}
ExecStart={VENV}/bin/tiered-ckpt retention apply --json --log-format json
"""
    timer = f"""[Unit]
Description=Run tiered-ckpt retention on a schedule (once per cluster: this host only)

[Timer]
OnCalendar={n.schedule}
RandomizedDelaySec=60
Persistent=true

[Install]
WantedBy=timers.target
"""
    return [{"path": f"/etc/systemd/system/{UNIT}.service", "permissions": "0644", "content": service},
            {"path": f"/etc/systemd/system/{UNIT}.timer", "permissions": "0644", "content": timer}]


def _healthcheck(n: NodeInputs) -> str:
    # slurm.conf(5) HealthCheckProgram: slurmd runs it as root every HealthCheckInterval; it drains its own
    # node, so no job starts on a node without the checkpoint file system or with GPUs missing.
    return f"""#!/bin/bash
# tiered-ckpt Slurm health check (generated by the Pulumi program; see components/cloud_init.py)
PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
problems=()
# stat first: {MOUNT} is an automount point (fstab x-systemd.automount), the access mounts it.
if ! timeout 30 stat -t {MOUNT}/ >/dev/null 2>&1; then
  problems+=("lustre {MOUNT} not responding")
elif ! findmnt -n -t lustre {MOUNT} >/dev/null; then
  problems+=("lustre {MOUNT} not mounted")
fi
gpus=$(timeout 60 nvidia-smi -L 2>/dev/null | grep -c '^GPU ')
[ "${{gpus:-0}}" -ge {n.gpus_per_node} ] || problems+=("${{gpus:-0}} of {n.gpus_per_node} GPUs visible")
if [ ${{#problems[@]}} -gt 0 ]; then
  reason="tiered-ckpt health: $(IFS=';'; echo "${{problems[*]}}")"
  logger -t tiered-ckpt-healthcheck "$reason"
  scontrol update nodename="$(hostname -s)" state=drain reason="$reason"
fi
exit 0
"""


def _slurm_files(n: NodeInputs) -> list[dict[str, str]]:
    if n.slurm is None:
        return []
    conf = n.slurm.conf
    files = [
        {"path": "/etc/slurm/slurm.conf", "permissions": "0644", "content": slurm_conf.render_slurm_conf(conf)},
        {"path": "/etc/slurm/gres.conf", "permissions": "0644", "content": slurm_conf.render_gres_conf(conf)},
        {"path": "/etc/slurm/cgroup.conf", "permissions": "0644", "content": slurm_conf.render_cgroup_conf(conf)},
        {"path": "/etc/tmpfiles.d/tiered-ckpt-slurm.conf", "permissions": "0644",
         "content": f"d {conf.run_dir} 0755 {conf.slurm_user} {conf.slurm_user} -\n"},
        {"path": MUNGE_KEY_TOOL, "permissions": "0755",
         "content": (SCRIPTS / "munge_key.py").read_text().replace(
             'ap.add_argument("--vault", required=True', f'ap.add_argument("--vault", default={n.slurm.vault_url!r}').replace(
             'ap.add_argument("--secret", required=True', f'ap.add_argument("--secret", default={n.slurm.secret_name!r}').replace(
             'ap.add_argument("--client-id", required=True', f'ap.add_argument("--client-id", default={n.slurm.vault_client_id!r}')},
    ]
    drain = " --drain" if n.role == ROLE_NODE else ""
    # With the memory tier on, the watcher tells the job first (its memory.notice_file).
    notice = f" --notice {MemoryConfig().notice_file}" if n.memory_keep and n.role == ROLE_NODE else ""
    files += [
        {"path": EVENTS_TOOL, "permissions": "0755", "content": (SCRIPTS / "scheduled_events.py").read_text()},
        {"path": f"/etc/systemd/system/{EVENTS_UNIT}.service", "permissions": "0644", "content": f"""[Unit]
Description=tiered-ckpt: drain, unmount Lustre and acknowledge on an Azure Terminate/Preempt notice
After=network-online.target remote-fs.target
Wants=network-online.target

[Service]
ExecStart=/usr/bin/python3 {EVENTS_TOOL} --mount {MOUNT}{drain}{notice}
Restart=always
RestartSec=5

[Install]
WantedBy=multi-user.target
"""},
    ]
    if n.role == ROLE_NODE:
        args = " ".join(f'"{a}"' if " " in a else a for a in slurm_conf.slurmd_args(conf))
        files += [
            {"path": HEALTHCHECK, "permissions": "0755", "content": _healthcheck(n)},
            # A dynamic node (slurmd -Z) registers itself with its GRES and the partition's feature.
            {"path": "/etc/systemd/system/slurmd.service.d/tiered-ckpt.conf", "permissions": "0644", "content": f"""[Unit]
After=munge.service remote-fs.target
RequiresMountsFor={MOUNT}

[Service]
ExecStart=
ExecStart=/usr/sbin/slurmd -D -s {args}
"""},
        ]
    return files


def _nccl_profile(n: NodeInputs) -> list[dict[str, str]]:
    if not n.nccl_topo_file:
        return []
    lines = [f"export NCCL_TOPO_FILE={n.nccl_topo_file}"] + [f"export {k}={v}" for k, v in NCCL_ENV]
    return [{"path": NCCL_PROFILE, "permissions": "0644",
             "content": "# NCCL on ND InfiniBand nodes (tiered-ckpt; sbatch scripts source this file)\n" + "\n".join(lines) + "\n"}]


def files(n: NodeInputs) -> list[dict[str, str]]:
    """Every file the VM gets (cloud-init write_files entries), the bootstrap last."""
    out = [{"path": CONFIG_PATH, "permissions": "0644", "owner": "root:root", "content": dump(node_config(n))},
           {"path": NODE_REQUIREMENTS, "permissions": "0644", "owner": "root:root", "content": node_lock.LOCK.read_text()}]
    out += (_retention_units(n) if n.retention else []) + _slurm_files(n) + _nccl_profile(n)
    out.append({"path": BOOTSTRAP, "permissions": "0755", "content": _bootstrap(n)})
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
# identity of the stack output nodeIdentityId (client ID {n.identity_client_id}), e.g.
#   az vmss identity assign -g <cluster rg> -n <scale set> --identities <nodeIdentityId>
# Run as root on every node:    sudo bash tiered-ckpt-bootstrap.sh
# and on exactly ONE host (retention runs once per cluster, under its per-model lock):
#                               sudo bash tiered-ckpt-bootstrap.sh --retention
# (CycleCloud: the scheduler node; AKS: one node of one pool, or run `tiered-ckpt retention apply` as a CronJob.)
set -euo pipefail
RETENTION=0
[ "${{1:-}}" = --retention ] && RETENTION=1
export RETENTION
apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q {' '.join(PACKAGES)}
"""]
    for i, f in enumerate(files(n)):
        marker = f"TIERED_CKPT_EOF_{i}"
        if marker in f["content"]:
            raise ValueError(f"{f['path']}: content holds the heredoc marker {marker}")
        parts.append(f"install -D -m {f['permissions']} /dev/stdin {f['path']} <<'{marker}'\n{f['content']}"
                     f"{'' if f['content'].endswith(chr(10)) else chr(10)}{marker}\n")
    parts.append(f"exec {BOOTSTRAP}\n")
    return "".join(parts)


def encode(text: str) -> str:
    """Base64 as ARM expects customData; refuses to exceed Azure's limit."""
    raw = text.encode()
    if len(raw) > CUSTOM_DATA_LIMIT:
        raise ValueError(f"custom data is {len(raw)} bytes, above Azure's {CUSTOM_DATA_LIMIT}-byte limit")
    return base64.b64encode(raw).decode()
