#!/bin/bash
# tiered-ckpt boot of an ND node (slurmd; ROLE=node), or of a node of a cluster you bring (ROLE=byo: no
# Slurm of ours; `--retention` on exactly one host). Run once by cloud-init (runcmd) as root; settings from
# /etc/tiered-ckpt/boot.env (components/node/cloud_init.py writes both).
set -euo pipefail
# shellcheck source-path=SCRIPTDIR source=lib/boot-common.sh
. "${SYSROOT:-}/usr/local/lib/tiered-ckpt/boot-common.sh"
load_settings ROLE MOUNT MGS FSTAB_OPTIONS VENV NODE_REQUIREMENTS TOOLS_URL TOOLS_SHA256 IDENTITY_CLIENT_ID IMDS \
  ADMIN_USER TRAINING_USER TRAINING_GROUP TRAINING_UID TRAINING_GID SERVICE_USER SERVICE_ID WORK_DIR LUSTRE_ROOT \
  MODEL RECORDS_DIR
[ "${1:-}" = --retention ] && RETENTION=1

lustre_client
mount_amlfs
toolkit
users_and_tree
if [ "${RETENTION:-0}" = 1 ]; then
  load_settings RETENTION_ACTION RETENTION_SCHEDULE
  retention_units
else
  systemctl disable --now tiered-ckpt-retention.timer >/dev/null 2>&1 || true
fi

if [ "${SLURM:-0}" = 1 ]; then
  load_settings SLURM_VERSION SLURM_PACKAGES SLURM_USER SLURM_UID SLURM_GID MUNGE_UID MUNGE_GID SLURM_LOG_DIR SLURM_SPOOL_DIR \
    SLURMD_DEFAULTS MUNGE_KEY_TOOL VAULT_URL MUNGE_SECRET VAULT_CLIENT_ID
  # shellcheck disable=SC2086  # one package name per word
  install_slurm $SLURM_PACKAGES
  slurm_dirs
  mkdir -p "$SYSROOT$SLURM_SPOOL_DIR"
  munge_key fetch
  systemctl enable munge
  systemctl restart munge
  # slurmd: the packaged unit as it is (23.11+: Type=notify, ExecStart=slurmd --systemd $SLURMD_OPTIONS;
  # SchedMD etc/slurmd.service.in), its options (-Z --conf "...": a dynamic node) in /etc/default/slurmd,
  # which the unit reads. Written after the install: the package ships that file as a conffile.
  install -m 0644 "$SYSROOT$SLURMD_DEFAULTS" "$SYSROOT/etc/default/slurmd"
  mkdir -p "$SYSROOT/etc/systemd/system/slurmd.service.d"
  printf '[Unit]\nAfter=munge.service remote-fs.target\nRequiresMountsFor=%s\n' "$MOUNT" \
    > "$SYSROOT/etc/systemd/system/slurmd.service.d/10-tiered-ckpt.conf"
  systemctl daemon-reload
  systemctl enable slurmd
  systemctl restart slurmd || die "slurmd did not start: journalctl -u slurmd"
  events_watcher "--drain${MEMORY_NOTICE:+ --notice $MEMORY_NOTICE}"
fi
log "done"
