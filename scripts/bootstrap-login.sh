#!/bin/bash
# tiered-ckpt boot of the login/controller VM: Lustre, the toolkit, retention (once per cluster), slurmctld
# with its state on Lustre, the cleanup of departed dynamic nodes. Run once by cloud-init (runcmd) as root;
# settings from /etc/tiered-ckpt/boot.env (components/node/cloud_init.py writes both).
set -euo pipefail
# shellcheck source-path=SCRIPTDIR source=lib/boot-common.sh
. "${SYSROOT:-}/usr/local/lib/tiered-ckpt/boot-common.sh"
load_settings ROLE MOUNT MGS FSTAB_OPTIONS VENV NODE_REQUIREMENTS TOOLS_URL TOOLS_SHA256 IDENTITY_CLIENT_ID IMDS \
  ADMIN_USER TRAINING_USER TRAINING_GROUP TRAINING_UID TRAINING_GID SERVICE_USER SERVICE_ID WORK_DIR LUSTRE_ROOT \
  MODEL RECORDS_DIR RETENTION_ACTION RETENTION_SCHEDULE SLURM_VERSION SLURM_PACKAGES SLURM_USER SLURM_UID SLURM_GID MUNGE_UID \
  MUNGE_GID SLURM_LOG_DIR SLURM_STATE_DIR MUNGE_KEY_TOOL VAULT_URL MUNGE_SECRET VAULT_CLIENT_ID

lustre_client
mount_amlfs
toolkit
users_and_tree
retention_units

# shellcheck disable=SC2086  # one package name per word
install_slurm $SLURM_PACKAGES
slurm_dirs
munge_key init
systemctl enable munge
systemctl restart munge
# slurmctld's state on Lustre: a replaced login VM picks up the queue where the old one left it (the fixed
# SlurmUser uid keeps the files its own).
mkdir -p "$SYSROOT$SLURM_STATE_DIR"
chown -R "$SLURM_USER:$SLURM_USER" "$SYSROOT$SLURM_STATE_DIR" "$SYSROOT$SLURM_LOG_DIR"
chmod 0750 "$SYSROOT$SLURM_STATE_DIR"
# The packaged unit as it is (23.11+: Type=notify, User=slurm, slurmctld --systemd; SchedMD
# etc/slurmctld.service.in); it must wait for the state directory's file system.
mkdir -p "$SYSROOT/etc/systemd/system/slurmctld.service.d"
printf '[Unit]\nAfter=munge.service remote-fs.target\nRequiresMountsFor=%s\n' "$MOUNT" \
  > "$SYSROOT/etc/systemd/system/slurmctld.service.d/10-tiered-ckpt.conf"
systemctl daemon-reload
systemctl enable slurmctld
systemctl restart slurmctld || die "slurmctld did not start: journalctl -u slurmctld"
# Dynamic nodes stay registered until deleted (SchedMD dynamic_nodes.shtml, "Deleting Nodes"): a timer
# deletes the ones that stayed DOWN (a scale-in or a lost VM that gave no notice).
systemctl enable --now tiered-ckpt-slurm-cleanup.timer
events_watcher ""
log "done"
