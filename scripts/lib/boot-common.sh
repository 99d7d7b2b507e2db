# shellcheck shell=bash
# Steps shared by the tiered-ckpt node boot (sourced by bootstrap-login.sh and bootstrap-node.sh).
#
# Settings arrive in an environment file that the VM's custom data writes (/etc/tiered-ckpt/boot.env,
# rendered by components/node/cloud_init.py); nothing here is filled in by text substitution. SYSROOT (empty on a
# VM) prefixes every file this touches, so tests run the same steps against an image double in a directory.
# Every step is idempotent: a re-run after a failure (or a reimage) converges.

SYSROOT=${SYSROOT:-}
RETRY_SLEEP=${RETRY_SLEEP:-10}
export DEBIAN_FRONTEND=noninteractive

log() { echo "tiered-ckpt-bootstrap: $*"; }
die() { echo "tiered-ckpt-bootstrap: error: $*" >&2; exit 1; }

# load_settings NAME...: source the environment file and refuse to go on without the named settings.
load_settings() {
  local env=${BOOT_ENV:-$SYSROOT/etc/tiered-ckpt/boot.env} k missing=()
  [ -r "$env" ] || die "$env is missing: the VM's custom data writes it (components/node/cloud_init.py)"
  # shellcheck source=/dev/null
  . "$env"
  for k in "$@"; do [ -n "${!k:-}" ] || missing+=("$k"); done
  [ ${#missing[@]} -eq 0 ] || die "$env lacks ${missing[*]}"
}

# Installed packages whose name matches a glob, newest version first. dpkg-query also lists removed but
# configured ("rc") packages: only "ii" counts.
installed_pkgs() {
  dpkg-query -W -f='${Package} ${db:Status-Abbrev}\n' "$1" 2>/dev/null | awk '$2 ~ /^ii/ {print $1}' | sort -rV || true
}

# mokutil(1) --sb-state prints "SecureBoot enabled" or "SecureBoot disabled". Where it cannot tell (no
# mokutil, no EFI variables) the deployment's own setting decides, and an unknown one counts as on: the
# signed client loads either way, an unsigned one only with Secure Boot off.
secure_boot_on() {
  local state
  if state=$(mokutil --sb-state 2>/dev/null); then
    case "$state" in *"SecureBoot enabled"*) return 0 ;; *) return 1 ;; esac
  fi
  [ "${TIERED_SECURE_BOOT:-unknown}" != false ]
}

hold_kernel() {
  local kernel=$1
  apt-mark hold linux-azure linux-image-azure linux-headers-azure "linux-image-$kernel" "linux-headers-$kernel" >/dev/null 2>&1 || true
}

amlfs_repo() {
  # The Ubuntu-HPC image configures it (Azure/azhpc-images ubuntu/common/setup_lustre_repo.sh); other images
  # get the same line and Microsoft's key.
  local list=$SYSROOT/etc/apt/sources.list.d/amlfs.list codename key=$SYSROOT/usr/share/keyrings/microsoft-amlfs.gpg
  if [ ! -s "$list" ]; then
    # shellcheck source=/dev/null
    codename=$(. "$SYSROOT/etc/os-release" && echo "$VERSION_CODENAME")
    curl -fsSL https://packages.microsoft.com/keys/microsoft.asc | gpg --dearmor --yes -o "$key"
    echo "deb [arch=$(dpkg --print-architecture) signed-by=/usr/share/keyrings/microsoft-amlfs.gpg] https://packages.microsoft.com/repos/amlfs-$codename/ $codename main" > "$list"
  fi
  apt-get update -q
}

# Signed prebuilt client (Secure Boot on): the metapackage amlfs-lustre-client-<version> whose package version
# is the kernel release (azure-managed-lustre client-install-plan.md, "prebuilt kmod"; its modules are signed
# with the certificate Trusted Launch's firmware trusts: client-secure-boot.md). One kernel per kmod: the kernel
# is held. DKMS and kmod never both (client-install-plan.md): the image's DKMS client is removed first.
lustre_kmod() {
  local kernel=$1 want pkg name
  for pkg in $(installed_pkgs 'amlfs-lustre-client-[0-9]*'); do
    if [ "$(dpkg-query -W -f='${Version}' "$pkg" 2>/dev/null)" = "$kernel" ]; then
      log "Lustre client: $pkg=$kernel (signed kmod) already installed"; hold_kernel "$kernel"; return 0
    fi
  done
  amlfs_repo
  want=$(installed_pkgs 'amlfs-lustre-client-dkms-*' | head -n1)
  want=${want#amlfs-lustre-client-dkms-}
  pkg=""
  for name in $(apt-cache search --names-only '^amlfs-lustre-client-[0-9]' | awk '{print $1}' | sort -rV); do
    apt-cache madison "$name" | awk -F'|' '{gsub(/ /, "", $2); print $2}' | grep -qxF "$kernel" || continue
    if [ -z "$pkg" ] || [ "$name" = "amlfs-lustre-client-$want" ]; then pkg=$name; fi
  done
  [ -n "$pkg" ] || die "Secure Boot is on and the AMLFS repository has no signed Lustre client (amlfs-lustre-client-<version>=$kernel) for kernel $kernel. DKMS modules are unsigned and do not load under Secure Boot (azure-managed-lustre client-install-plan.md). Fix: turn Secure Boot off for this VM (securityProfile uefiSettings secureBootEnabled false) or use an image whose kernel the AMLFS support matrix lists"
  local dkms
  dkms=$(installed_pkgs 'amlfs-lustre-client-dkms-*'; installed_pkgs 'lustre-client-modules-dkms*')
  if [ -n "$dkms" ]; then
    log "removing the unsigned DKMS client ($(echo "$dkms" | tr '\n' ' ')) for the signed kmod"
    # shellcheck disable=SC2086  # one package name per word
    apt-get remove -y -q $dkms
  fi
  log "installing $pkg=$kernel (signed kmod)"
  apt-get install -y -q "$pkg=$kernel" || die "apt-get could not install $pkg=$kernel"
  apt-mark hold "$pkg" >/dev/null
  hold_kernel "$kernel"
}

# DKMS client (Secure Boot off): what current Ubuntu-HPC images ship (amlfs-lustre-client-dkms-<version>,
# Azure/azhpc-images install_lustre_client.sh); DKMS rebuilds it for each kernel, so the kernel is not held.
lustre_dkms() {
  local kernel=$1 pkg
  pkg=$(installed_pkgs 'amlfs-lustre-client-dkms-*' | head -n1)
  if [ -n "$pkg" ]; then
    log "Lustre client: $pkg (DKMS, from the image)"
    modinfo lustre >/dev/null 2>&1 || dkms autoinstall || die "DKMS could not build the Lustre module for kernel $kernel"
  elif modinfo lustre >/dev/null 2>&1; then
    log "Lustre client: prebuilt kmod from the image; holding kernel $kernel"
    hold_kernel "$kernel"
  else
    log "installing the AMLFS Lustre DKMS client for kernel $kernel"
    amlfs_repo
    pkg=$(apt-cache search --names-only '^amlfs-lustre-client-dkms-' | awk '{print $1}' | sort -rV | head -n1)
    [ -n "$pkg" ] || die "no amlfs-lustre-client-dkms package in the AMLFS repository for this release"
    apt-get install -y -q "linux-headers-$kernel" "$pkg" || die "apt-get could not install $pkg"
  fi
}

# TIERED_LUSTRE_CLIENT (components/settings/vm_security.py decides it for our VMs): auto (signed kmod under Secure
# Boot, the image's DKMS client otherwise), kmod or dkms.
lustre_client() {
  local kernel sb=off mode=${TIERED_LUSTRE_CLIENT:-auto}
  kernel=$(uname -r)
  if secure_boot_on; then sb=on; fi
  if [ "$sb" = on ] && [ "$mode" = dkms ]; then
    die "Secure Boot is on and lustreClient is dkms: DKMS modules are unsigned and do not load under Secure Boot (azure-managed-lustre client-install-plan.md). Fix: turn Secure Boot off for this VM or use the signed kmod client"
  fi
  if [ "$mode" = auto ]; then
    if [ "$sb" = on ]; then mode=kmod; else mode=dkms; fi
  fi
  log "Lustre client path: $mode (Secure Boot $sb, kernel $kernel)"
  if [ "$mode" = kmod ]; then lustre_kmod "$kernel"; else lustre_dkms "$kernel"; fi
  modprobe lustre || die "the Lustre kernel module does not load on kernel $kernel (Secure Boot $sb; an unsigned DKMS module needs Secure Boot off)"
}

# fstab as the AMLFS docs' automount example: _netdev, x-systemd.automount (mounted on first access, so boot
# never waits for the MGS: systemd.mount(5)), nofail (an unreachable file system never drops the VM into
# emergency mode; the health check drains it).
mount_amlfs() {
  local fstab=$SYSROOT/etc/fstab unit i
  mkdir -p "$SYSROOT$MOUNT"
  touch "$fstab"
  sed -i "\\| $MOUNT lustre |d" "$fstab"
  echo "$MGS@tcp:/lustrefs $MOUNT lustre $FSTAB_OPTIONS 0 0" >> "$fstab"
  unit=$(systemd-escape -p --suffix=automount "$MOUNT")
  systemctl daemon-reload      # systemd-fstab-generator(8) turns the entry into $unit
  systemctl start "$unit"
  for i in $(seq 1 "${MOUNT_TRIES:-30}"); do
    findmnt -n -t lustre "$SYSROOT$MOUNT" >/dev/null && break
    timeout 60 stat -t "$SYSROOT$MOUNT/" >/dev/null 2>&1 || sleep "$RETRY_SLEEP"     # the first access mounts it
  done
  findmnt -n -t lustre "$SYSROOT$MOUNT" >/dev/null || die "could not mount $MOUNT from $MGS@tcp"
}

# The toolkit: a private blob fetched with the node's managed identity (IMDS token), verified by sha256.
# Role assignments can take minutes to propagate: retried. The bearer token never appears on a command line
# (any user sees those in ps): python writes the header line into a mode-0600 file (mktemp(1)) that curl
# reads with -H @file.
fetch_toolkit() {
  local tarball=$1 tries=${2:-90} hdr ok=0 i
  local token_url="$IMDS/metadata/identity/oauth2/token?api-version=2018-02-01&resource=https%3A%2F%2Fstorage.azure.com%2F&client_id=$IDENTITY_CLIENT_ID"
  hdr=$(mktemp)
  for i in $(seq 1 "$tries"); do
    if curl -fsS -H Metadata:true "$token_url" \
         | python3 -c 'import json,sys; print("Authorization: Bearer " + json.load(sys.stdin)["access_token"])' > "$hdr" \
       && curl -fsS -o "$tarball" -H @"$hdr" -H "x-ms-version: 2021-08-06" "$TOOLS_URL"; then
      if echo "$TOOLS_SHA256  $tarball" | sha256sum -c --status; then ok=1; break; fi
      log "toolkit checksum mismatch; retrying"
    fi
    [ "$i" = "$tries" ] || sleep "$RETRY_SLEEP"
  done
  rm -f "$hdr"
  [ "$ok" = 1 ]
}

# Dependencies in pip's hash-checking mode from the lock the program ships (components/node/node_lock.py): every
# wheel pinned and its sha256 checked; then the toolkit itself (already sha256-checked) with no dependency
# resolution, no index and no build isolation.
install_toolkit() {
  local tarball=$1 vdir=$SYSROOT$VENV
  rm -rf "$vdir/src" && mkdir -p "$vdir/src"
  tar -xzf "$tarball" -C "$vdir/src"
  python3 -m venv "$vdir"
  "$vdir/bin/pip" install -q --require-hashes --only-binary=:all: -r "$SYSROOT$NODE_REQUIREMENTS"
  "$vdir/bin/pip" install -q --no-deps --no-index --no-build-isolation "$vdir/src"
  mkdir -p "$SYSROOT/usr/local/bin"
  ln -sf "$VENV/bin/tiered-ckpt" "$SYSROOT/usr/local/bin/tiered-ckpt"
}

toolkit() {
  mkdir -p "$SYSROOT/var/lib/tiered-ckpt"
  fetch_toolkit "$SYSROOT/var/lib/tiered-ckpt/toolkit.tar.gz" || die "could not fetch the toolkit from $TOOLS_URL"
  install_toolkit "$SYSROOT/var/lib/tiered-ckpt/toolkit.tar.gz"
}

# ensure_group NAME GID / ensure_user NAME UID GROUP: fixed ids. Every VM mounts the same file system and
# Slurm checks uids across hosts, so a name must map to the same number everywhere (a dynamically allocated
# system id differs between VMs as soon as their package sets differ).
ensure_group() {
  local name=$1 gid=$2 have
  if have=$(getent group "$name"); then
    [ "$(echo "$have" | cut -d: -f3)" = "$gid" ] || die "group $name exists with gid $(echo "$have" | cut -d: -f3), not $gid; every VM must use the same"
  else
    groupadd --system --gid "$gid" "$name"
  fi
}

ensure_user() {
  local name=$1 uid=$2 group=$3 have
  if have=$(getent passwd "$name"); then
    [ "$(echo "$have" | cut -d: -f3)" = "$uid" ] || die "user $name exists with uid $(echo "$have" | cut -d: -f3), not $uid; every VM must use the same"
  else
    useradd --system --uid "$uid" --gid "$group" --no-create-home --home-dir /nonexistent --shell /usr/sbin/nologin "$name"
  fi
}

# shared_dir DIR: group-shared, setgid, and a default ACL giving the training group and the retention user
# rwx whatever the writer's umask (acl(5)).
shared_dir() {
  local d=$1
  mkdir -p "$d"
  chown "$TRAINING_USER:$TRAINING_GROUP" "$d"
  chmod 2775 "$d"
  setfacl -m "g:$TRAINING_GROUP:rwx,d:g:$TRAINING_GROUP:rwx,g:$SERVICE_USER:rwx,d:g:$SERVICE_USER:rwx" "$d" \
    || log "no ACL support on $d: training jobs must use umask 002"
}

# Users and the checkpoint tree. Training ranks (TRAINING_USER, group TRAINING_GROUP) write checkpoints;
# retention runs as the unprivileged system user SERVICE_USER, so a symlink or FIFO planted in the shared
# tree can never redirect a root-owned delete or write.
users_and_tree() {
  ensure_group "$SERVICE_USER" "$SERVICE_ID"
  ensure_user "$SERVICE_USER" "$SERVICE_ID" "$SERVICE_USER"
  if getent group "$TRAINING_GROUP" >/dev/null; then
    [ "$(getent group "$TRAINING_GROUP" | cut -d: -f3)" = "$TRAINING_GID" ] \
      || die "group $TRAINING_GROUP exists with another gid than $TRAINING_GID; every VM must use the same"
  else
    groupadd --gid "$TRAINING_GID" "$TRAINING_GROUP"
  fi
  if [ "$TRAINING_USER" != "$ADMIN_USER" ] && ! getent passwd "$TRAINING_USER" >/dev/null; then
    useradd --uid "$TRAINING_UID" --gid "$TRAINING_GROUP" --create-home --shell /bin/bash "$TRAINING_USER"
  fi
  local u
  for u in "$TRAINING_USER" "$ADMIN_USER" "$SERVICE_USER"; do
    if getent passwd "$u" >/dev/null; then usermod -aG "$TRAINING_GROUP" "$u"; fi
  done
  # A shared working directory for job files and training virtualenvs (sbatch runs the script from the
  # submit directory; home directories are per VM). Not under the checkpoint prefix: never exported.
  mkdir -p "$SYSROOT$MOUNT/$WORK_DIR"
  chown ":$TRAINING_GROUP" "$SYSROOT$MOUNT/$WORK_DIR"
  chmod 2775 "$SYSROOT$MOUNT/$WORK_DIR"
  shared_dir "$SYSROOT$LUSTRE_ROOT"
  shared_dir "$SYSROOT$LUSTRE_ROOT/$MODEL"
  # The toolkit's operation records (src/tiered_ckpt/records.py: next to the root, not inside it), written
  # by training ranks and by retention alike.
  shared_dir "$SYSROOT$(dirname "$RECORDS_DIR")"
  shared_dir "$SYSROOT$RECORDS_DIR"
}

# Retention (once per cluster): the packaged units from scripts/systemd plus this VM's settings as a drop-in.
# Only `lfs hsm_release` needs a capability (CAP_SYS_ADMIN; Lustre's HSM request masks): with action delete
# the service keeps none.
retention_units() {
  local d=$SYSROOT/etc/systemd/system caps=""
  [ "$RETENTION_ACTION" = release ] && caps=CAP_SYS_ADMIN
  mkdir -p "$d/tiered-ckpt-retention.service.d" "$d/tiered-ckpt-retention.timer.d"
  cat > "$d/tiered-ckpt-retention.service.d/10-boot.conf" <<EOF
# tiered-ckpt: this VM's settings (scripts/lib/boot-common.sh, from /etc/tiered-ckpt/boot.env)
[Unit]
RequiresMountsFor=$MOUNT

[Service]
User=$SERVICE_USER
Group=$SERVICE_USER
SupplementaryGroups=$TRAINING_GROUP
AmbientCapabilities=$caps
CapabilityBoundingSet=$caps
EOF
  cat > "$d/tiered-ckpt-retention.timer.d/10-boot.conf" <<EOF
[Timer]
OnCalendar=
OnCalendar=$RETENTION_SCHEDULE
EOF
  systemctl daemon-reload
  systemctl enable --now tiered-ckpt-retention.timer
}

# Slurm from Microsoft's repository, as Microsoft's installer does it (Azure/cyclecloud-slurm
# azure-slurm-install/ubuntu.sh): the Ubuntu-HPC image pins Ubuntu's slurm* to priority -1
# (/etc/apt/preferences.d/slurm-repository-pin-990; Azure/azhpc-images components/slurm-repo/slurm-u.pin), so
# only packages.microsoft.com's slurm-smd* have a candidate. One pinned version on every VM, held. Users
# first, with fixed ids (CycleCloud's 11100/11101): the slurm-smd packages create none, and Ubuntu's munge
# package would create munge with a dynamic id.
slurm_repo() {
  if ! grep -qs 'repos/slurm-ubuntu-' "$SYSROOT"/etc/apt/sources.list.d/*; then
    local codename
    # shellcheck source=/dev/null
    codename=$(. "$SYSROOT/etc/os-release" && echo "$VERSION_CODENAME")
    echo "deb [arch=$(dpkg --print-architecture) signed-by=/usr/share/keyrings/microsoft-prod.gpg] https://packages.microsoft.com/repos/slurm-ubuntu-$codename/ stable main" \
      > "$SYSROOT/etc/apt/sources.list.d/slurm.list"
    printf 'Package: slurm, slurm-*\nPin: origin "packages.microsoft.com"\nPin-Priority: 990\n\nPackage: slurm, slurm-*\nPin: origin *ubuntu.com*\nPin-Priority: -1\n' \
      > "$SYSROOT/etc/apt/preferences.d/slurm-repository-pin-990"
  fi
  apt-get update -q
}

install_slurm() {
  local p pkgs=()
  ensure_group munge "$MUNGE_GID"
  ensure_user munge "$MUNGE_UID" munge
  ensure_group "$SLURM_USER" "$SLURM_GID"
  ensure_user "$SLURM_USER" "$SLURM_UID" "$SLURM_USER"
  slurm_repo
  apt-get install -y -q munge || die "apt-get could not install munge"
  for p in "$@"; do pkgs+=("$p=$SLURM_VERSION"); done
  apt-get install -y -q "${pkgs[@]}" \
    || die "apt-get could not install ${pkgs[*]} from packages.microsoft.com (slurmVersion $SLURM_VERSION; list the versions there with: apt-cache madison slurm-smd)"
  apt-mark hold "$@" >/dev/null
  log "Slurm $SLURM_VERSION: $*"
}

# The munge key from Key Vault with this VM's identity (never in custom data); munged(8) refuses a key that
# is not the munge user's and mode 0400.
munge_key() {
  local mode=$1 key=$SYSROOT/etc/munge/munge.key
  mkdir -p "$SYSROOT/etc/munge"
  "$SYSROOT$MUNGE_KEY_TOOL" "$mode" --vault "$VAULT_URL" --secret "$MUNGE_SECRET" --client-id "$VAULT_CLIENT_ID" \
    --imds "$IMDS" --key-file "$key" --owner "" || die "no munge key (see the message above)"
  chown munge:munge "$key"
  chmod 0400 "$key"
}

# slurm.conf's run directory now, not only from the next boot (tmpfiles.d(5)).
slurm_dirs() {
  systemd-tmpfiles --create "$SYSROOT/etc/tmpfiles.d/tiered-ckpt-slurm.conf"
  mkdir -p "$SYSROOT$SLURM_LOG_DIR"
}

# The Scheduled Events watcher; EVENTS_OPTIONS reaches it through /etc/default (scripts/systemd unit).
events_watcher() {
  mkdir -p "$SYSROOT/etc/default"
  echo "EVENTS_OPTIONS=--mount $MOUNT $1" > "$SYSROOT/etc/default/tiered-ckpt-scheduled-events"
  systemctl daemon-reload
  systemctl enable --now tiered-ckpt-scheduled-events.service
}
