#!/bin/bash
# Delete dynamic nodes that left without notice (SchedMD dynamic_nodes.shtml, "Deleting Nodes": a dynamic
# node stays registered, DOWN, until `scontrol delete`; each scale-out brings new hostnames, and the ghosts
# count against MaxNodeCount). Run on the controller by tiered-ckpt-slurm-cleanup.timer. A node is deleted
# when it was DOWN at the previous run too (a reboot's few minutes of "not responding" never count) and runs
# no job; the Scheduled Events watcher deletes the nodes that do get a Terminate notice itself.
set -euo pipefail
SYSROOT=${SYSROOT:-}
state=${CLEANUP_STATE:-$SYSROOT/var/lib/tiered-ckpt/down-nodes}
mkdir -p "$(dirname "$state")"
touch "$state"
# sinfo(1): -N one line per node, -t down (DOWN, with or without DRAIN), %n the node name.
now=$(sinfo -h -N -t down -o '%n' | sort -u)
deleted=0
for node in $now; do
  grep -qxF "$node" "$state" || continue          # first sighting: wait for the next run
  if [ -n "$(squeue -h -w "$node" -o '%i' 2>/dev/null)" ]; then continue; fi
  if scontrol delete nodename="$node"; then
    echo "tiered-ckpt-slurm-cleanup: deleted $node (DOWN since the previous run)"
    deleted=$((deleted + 1))
  fi
done
printf '%s\n' "$now" > "$state"
echo "tiered-ckpt-slurm-cleanup: $deleted deleted"
