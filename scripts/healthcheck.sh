#!/bin/bash
# tiered-ckpt Slurm health check (slurm.conf(5) HealthCheckProgram): slurmd runs it as root every
# HealthCheckInterval, with no arguments; it drains its own node, so no job starts on a node without the
# checkpoint file system or with GPUs missing. Settings: MOUNT and GPUS_PER_NODE from /etc/tiered-ckpt/boot.env.
SYSROOT=${SYSROOT:-}
export PATH="${PATH:+$PATH:}/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
# shellcheck source=/dev/null
. "${BOOT_ENV:-$SYSROOT/etc/tiered-ckpt/boot.env}" || exit 0
MOUNT=${MOUNT:-/lustrefs}
GPUS_PER_NODE=${GPUS_PER_NODE:-8}
problems=()
# stat first: the mount point is an automount (fstab x-systemd.automount), the access mounts it.
if ! timeout 30 stat -t "$SYSROOT$MOUNT/" >/dev/null 2>&1; then
  problems+=("lustre $MOUNT not responding")
elif ! findmnt -n -t lustre "$SYSROOT$MOUNT" >/dev/null; then
  problems+=("lustre $MOUNT not mounted")
fi
if [ "$GPUS_PER_NODE" -gt 0 ]; then
  gpus=$(timeout 60 nvidia-smi -L 2>/dev/null | grep -c '^GPU ')
  [ "${gpus:-0}" -ge "$GPUS_PER_NODE" ] || problems+=("${gpus:-0} of $GPUS_PER_NODE GPUs visible")
fi
if [ ${#problems[@]} -gt 0 ]; then
  reason="tiered-ckpt health: $(IFS=';'; echo "${problems[*]}")"
  logger -t tiered-ckpt-healthcheck "$reason"
  scontrol update nodename="$(hostname -s)" state=drain reason="$reason"
fi
exit 0
