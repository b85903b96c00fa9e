#!/usr/bin/env bash
# One shadow worker as a Slurm task, restarted into its own slot when it fails.
#
#     srun ... deploy/slurm/shadow-worker.sh MAX_RESTARTS METRICS_BASE KEY=VALUE...
#
# runs `shadow worker KEY=VALUE... worker_id=$SLURM_PROCID metrics_port=METRICS_BASE+$SLURM_LOCALID`.
# The task rank is the worker's slot, so a restarted worker retakes the same shard (what
# `shadow cluster` does on one host); its metrics port is unique on its node. After
# MAX_RESTARTS failures the slot stays empty and the coordinator reports the job degraded.
# SIGTERM (the job's teardown) stops the worker and ends the loop. RESTART_DELAY_S (2)
# spaces the restarts.
set -uo pipefail

if (( $# < 2 )); then
  echo "usage: $0 MAX_RESTARTS METRICS_BASE KEY=VALUE..." >&2
  exit 2
fi
max_restarts="$1"
metrics_base="$2"
shift 2
slot="${SLURM_PROCID:?run this as a Slurm task (srun)}"
metrics_port=$((metrics_base + ${SLURM_LOCALID:-0}))

child=""
stopping=0
stop() {
  stopping=1
  if [[ -n "$child" ]]; then kill -TERM "$child" 2>/dev/null; fi
}
trap stop TERM INT

restarts=0
while :; do
  shadow worker "$@" worker_id="$slot" metrics_port="$metrics_port" &
  child=$!
  wait "$child"
  rc=$?
  # a trapped signal interrupts the first wait; wait again for the worker's own exit
  if (( stopping )); then
    wait "$child" 2>/dev/null
    exit 0
  fi
  if (( rc == 0 )); then exit 0; fi
  if (( restarts >= max_restarts )); then
    echo "shadow worker slot $slot on $(hostname) exited with status $rc; $restarts restarts used, giving up" >&2
    exit "$rc"
  fi
  restarts=$((restarts + 1))
  echo "shadow worker slot $slot on $(hostname) exited with status $rc; restarting it ($restarts/$max_restarts)" >&2
  sleep "${RESTART_DELAY_S:-2}"
done
