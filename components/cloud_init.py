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

from tiered_ckpt.config import AmlfsConfig, ArchiveConfig, NodeConfig, RetentionConfig, dump, validate

CUSTOM_DATA_LIMIT = 65535   # bytes of decoded custom data Azure accepts
MOUNT = "/lustrefs"
VENV = "/opt/tiered-ckpt"
CONFIG_PATH = "/etc/tiered-ckpt/config.yaml"
UNIT = "tiered-ckpt-retention"
# The unprivileged system user the retention timer runs as, and the group that owns the checkpoint
# root (training users join it). Fixed ids: every node mounts the same file system, so the group
# must map to the same number everywhere (a dynamically allocated system id differs between nodes
# as soon as their package sets differ). Below 60000, Debian's globally reserved range.
SERVICE_USER = "tiered-ckpt"
SERVICE_ID = 2742
# IMDS: the only way a node gets a token for its user-assigned identity without a stored secret.
IMDS_TOKEN = "http://169.254.169.254/metadata/identity/oauth2/token?api-version=2018-02-01&resource=https%3A%2F%2Fstorage.azure.com%2F"


@dataclass(frozen=True)
class Toolkit:
    path: Path          # the built tarball
    sha256: str
    blob_name: str


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
    )
    validate(cfg)
    return cfg


def _bootstrap(n: NodeInputs) -> str:
    # Runs once from runcmd. Idempotent, so a re-run after a failure (or reimage) converges.
    return f"""#!/bin/bash
# tiered-ckpt node bootstrap (generated by the Pulumi program; see components/cloud_init.py)
set -euo pipefail
export DEBIAN_FRONTEND=noninteractive
log() {{ echo "tiered-ckpt-bootstrap: $*"; }}

# 1. Kernel held: an AMLFS Lustre client is built for one kernel; a newer kernel breaks the mount.
apt-mark hold linux-azure linux-image-azure linux-headers-azure "linux-image-$(uname -r)" "linux-headers-$(uname -r)" || true

# 2. Lustre client: the ubuntu-hpc image ships it; otherwise install the build matching this kernel.
if ! modinfo lustre >/dev/null 2>&1; then
  log "installing the AMLFS Lustre client for kernel $(uname -r)"
  . /etc/os-release
  curl -fsSL https://packages.microsoft.com/keys/microsoft.asc | gpg --dearmor --yes -o /usr/share/keyrings/microsoft-amlfs.gpg
  echo "deb [arch=amd64 signed-by=/usr/share/keyrings/microsoft-amlfs.gpg] https://packages.microsoft.com/repos/amlfs-${{VERSION_CODENAME}}/ ${{VERSION_CODENAME}} main" > /etc/apt/sources.list.d/amlfs.list
  apt-get update -q
  # Each amlfs-lustre-client-<lustre version> package has one version per kernel it was built for; the
  # newest Lustre release may not be built yet for this image's kernel, so take the newest that is.
  pkg=""
  for p in $(apt-cache search --names-only '^amlfs-lustre-client-' | awk '{{print $1}}' | sort -rV); do
    if apt-cache madison "$p" | awk -F'|' '{{gsub(/ /, "", $2); print $2}}' | grep -qxF "$(uname -r)"; then pkg=$p; break; fi
  done
  [ -n "$pkg" ] || {{ log "no amlfs-lustre-client package is built for kernel $(uname -r)"; exit 1; }}
  apt-get install -y -q "$pkg=$(uname -r)"
  apt-mark hold "$pkg"
fi

# 3. Mount AMLFS (fstab with _netdev so boot waits for the network).
mkdir -p {MOUNT}
grep -q ' {MOUNT} lustre ' /etc/fstab || echo '{n.mgs_address}@tcp:/lustrefs {MOUNT} lustre _netdev,noatime,flock 0 0' >> /etc/fstab
for i in $(seq 1 30); do mountpoint -q {MOUNT} && break; mount {MOUNT} || sleep 10; done
mountpoint -q {MOUNT} || {{ log "could not mount {MOUNT} from {n.mgs_address}@tcp"; exit 1; }}

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
{VENV}/bin/pip install -q --upgrade pip
{VENV}/bin/pip install -q {VENV}/src
ln -sf {VENV}/bin/tiered-ckpt /usr/local/bin/tiered-ckpt

# 5. Checkpoint root and the retention timer. Retention runs as an unprivileged system user, so a
#    symlink or FIFO planted in the shared tree can never redirect a root-owned delete or write.
#    It may delete only what the shared group may: the root and the model directory belong to that
#    group, setgid (new directories inherit the group), group-writable; the default ACL keeps new
#    checkpoint directories group-writable whatever the training job's umask (acl(5)).
getent group {SERVICE_USER} >/dev/null || groupadd --system --gid {SERVICE_ID} {SERVICE_USER}
getent passwd {SERVICE_USER} >/dev/null || useradd --system --uid {SERVICE_ID} --gid {SERVICE_USER} \\
  --no-create-home --home-dir /nonexistent --shell /usr/sbin/nologin {SERVICE_USER}
[ "$(getent group {SERVICE_USER} | cut -d: -f3)" = {SERVICE_ID} ] || {{ log "group {SERVICE_USER} exists with another gid than {SERVICE_ID}; every node must use the same"; exit 1; }}
mkdir -p {n.lustre_root}/{n.model}
for d in {n.lustre_root} {n.lustre_root}/{n.model}; do
  chgrp {SERVICE_USER} "$d"
  chmod 2775 "$d"
  setfacl -m g:{SERVICE_USER}:rwx,d:g:{SERVICE_USER}:rwx "$d" || log "no ACL support on $d: training jobs must use umask 002"
done
systemctl daemon-reload
systemctl enable --now {UNIT}.timer
log "done"
"""


def render(n: NodeInputs) -> str:
    """The #cloud-config document (text, before base64)."""
    # Not root (systemd.exec(5) User=/Group=): retention deletes in a tree other users can write.
    # Lustre lets an unprivileged user ask only for HSM restores by default (the coordinator's
    # user/group/other request masks are RESTORE; lfs-hsm(1), the Lustre manual's HSM chapter),
    # and AMLFS does not expose those masks: `lfs hsm_release` needs CAP_SYS_ADMIN, so with
    # action "release" the service keeps that one capability (ambient, nothing else). No
    # capability bypasses file permissions (CAP_DAC_OVERRIDE, CAP_FOWNER are not granted).
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
UMask=0002
{caps}NoNewPrivileges=yes
ProtectSystem=full
ProtectHome=yes
PrivateTmp=yes
Environment=TIERED_CKPT_CONFIG={CONFIG_PATH}
ExecStart={VENV}/bin/tiered-ckpt retention apply --json
"""
    timer = f"""[Unit]
Description=Run tiered-ckpt retention on a schedule

[Timer]
OnCalendar={n.schedule}
RandomizedDelaySec=60
Persistent=true

[Install]
WantedBy=timers.target
"""
    doc = {
        "package_update": True,
        "packages": ["python3-venv", "curl", "gnupg", "acl"],
        "write_files": [
            {"path": CONFIG_PATH, "permissions": "0644", "owner": "root:root", "content": dump(node_config(n))},
            {"path": f"/etc/systemd/system/{UNIT}.service", "permissions": "0644", "content": service},
            {"path": f"/etc/systemd/system/{UNIT}.timer", "permissions": "0644", "content": timer},
            {"path": "/usr/local/sbin/tiered-ckpt-bootstrap", "permissions": "0755", "content": _bootstrap(n)},
        ],
        "runcmd": [["/usr/local/sbin/tiered-ckpt-bootstrap"]],
    }
    return "#cloud-config\n" + yaml.safe_dump(doc, sort_keys=False, width=1000)


def encode(text: str) -> str:
    """Base64 as ARM expects customData; refuses to exceed Azure's limit."""
    raw = text.encode()
    if len(raw) > CUSTOM_DATA_LIMIT:
        raise ValueError(f"custom data is {len(raw)} bytes, above Azure's {CUSTOM_DATA_LIMIT}-byte limit")
    return base64.b64encode(raw).decode()
