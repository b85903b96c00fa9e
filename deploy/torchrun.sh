#!/usr/bin/env bash
# Start the trainer ranks of one node with torchrun, attached to a running shadow cluster.
#
# The cluster runs elsewhere (`shadow cluster`, deploy/slurm/shadow-job.sbatch, deploy/k8s);
# this script only needs its address. Every TCP port must be open between the trainer
# nodes and the shadow hosts: the coordinator listens on its `port` (5555), but each
# worker binds its data and serve sockets on ephemeral ports and the trainers connect to
# those directly.
#
# Single node (ranks = GPUs of this node, or NPROC_PER_NODE):
#
#     SHADOW_COORDINATOR=tcp://10.0.0.5:5555 deploy/torchrun.sh steps=1000
#
# Multi-node (run on every node, the same command except NODE_RANK; MASTER_ADDR is node 0):
#
#     SHADOW_COORDINATOR=tcp://10.0.0.5:5555 NNODES=4 NODE_RANK=$i MASTER_ADDR=gpu-node-0 \
#         deploy/torchrun.sh steps=1000
#
# A cluster bound beyond loopback runs with CURVE keys (docs/operations.md, Security): give
# the trainers the cluster's public key and the trainer pair (`shadow keygen role=trainer`),
# and let Prometheus scrape this host's address:
#
#     SHADOW_CURVE_SERVER_KEY=keys/server.key SHADOW_CURVE_CLIENT_KEY=keys/trainers/trainer.key_secret \
#         SHADOW_METRICS_HOST=auto SHADOW_COORDINATOR=tcp://10.0.0.5:5555 deploy/torchrun.sh steps=1000
#
# Arguments after the script name go to the training script, after the two this script
# adds: TRAIN_COORDINATOR_ARG followed by the address, and TRAIN_RESUME_ARG followed by
# auto, true or false (SHADOW_RESUME). The default training script is
# examples/train_gpt.py (the example GPT, key=value arguments; it trains on CPU with
# gloo). For your own trainer set TRAIN_SCRIPT and the two argument forms, e.g. for
# argparse: TRAIN_COORDINATOR_ARG=--coordinator= TRAIN_RESUME_ARG=--resume= ; the trainer
# hands the value to trainer_hooks.attach(resume=...) (or calls trainer_hooks.resume).
#
# Failures recover by themselves: torchrun restarts every rank of the job up to
# TRAIN_MAX_RESTARTS times after any rank fails, and each restarted rank, told
# resume=auto, restores the newest checkpoint the shadow holds before attaching (a fresh
# start when it holds none). Several nodes rendezvous with torchrun's c10d rendezvous, so
# a failure on one node restarts the ranks of every node.
#
# Environment:
#   SHADOW_COORDINATOR       coordinator address, tcp://HOST:PORT (required)
#   NPROC_PER_NODE           ranks on this node (default: the GPUs nvidia-smi lists, else 1)
#   NNODES, NODE_RANK        nodes in the job and this node's index (default 1, 0)
#   MASTER_ADDR, MASTER_PORT the rendezvous endpoint on node 0 (default 127.0.0.1, 29500)
#   SHADOW_RUN_ID            the rendezvous id every node of one job shares (default: the
#                            Slurm job id, else the job name, else "shadow-job")
#   TRAIN_MAX_RESTARTS      elastic restarts after a failure (default 3; 0: a failure ends
#                            the job, as plain torchrun)
#   SHADOW_METRICS_PORT      each rank serves Prometheus metrics on this + LOCAL_RANK
#                            (default 9500: ranks 0-7 use 9500-9507; "" = no metrics)
#   SHADOW_METRICS_HOST      the address those endpoints bind: default 127.0.0.1 (this host
#                            only, as the hooks' own default); "auto" = this host's own
#                            address, the one that routes to the coordinator (what `shadow
#                            worker host=auto` binds), for a Prometheus on another host; or
#                            an address (Kubernetes: the pod IP). Never every interface by default
#   SHADOW_CURVE_SERVER_KEY  the cluster's public key file (server.key), with
#   SHADOW_CURVE_CLIENT_KEY  this trainer's secret key file (trainer.key_secret, from `shadow
#                            keygen role=trainer`): set both when the cluster runs with
#                            security.server_key= (CURVE; required beyond loopback); unset: on
#                            the cluster's own host, this user's key set (~/.config/shadow/keys)
#   SHADOW_INSECURE          1: no keys at all (a cluster that runs without any)
#   SHADOW_RESUME            auto (default): every rank, at every launch and restart, resumes
#                            when the shadow holds a checkpoint of its job and starts fresh
#                            otherwise; always (true: no checkpoint is an error); never (false)
#   SHADOW_JOB               the job name the trainer attaches as (train_gpt.py: gpt): the
#                            job this script reports on before it starts
#   TRAIN_SCRIPT             default: examples/train_gpt.py next to this deploy/ folder
#   TRAIN_COORDINATOR_ARG    default "coordinator=" (the address is appended to it)
#   TRAIN_RESUME_ARG         default "resume=" (auto, true or false is appended to it)
#   TORCHRUN                 default torchrun
#
# A second launch of a job whose ranks are still alive is never let in: its attach waits
# until the live ranks have been silent for SHADOW_WORKER_LOST_S, and fails naming them
# (docs/operations.md, Recovery). A new run over a job the shadow still holds: a new
# SHADOW_JOB, or SHADOW_RESUME=never with the trainer's overwrite.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"

: "${SHADOW_COORDINATOR:?set SHADOW_COORDINATOR=tcp://HOST:PORT, the shadow coordinator address}"
NNODES="${NNODES:-1}"
NODE_RANK="${NODE_RANK:-0}"
MASTER_ADDR="${MASTER_ADDR:-127.0.0.1}"
MASTER_PORT="${MASTER_PORT:-29500}"
SHADOW_RESUME="${SHADOW_RESUME:-auto}"
TRAIN_MAX_RESTARTS="${TRAIN_MAX_RESTARTS:-3}"
TRAIN_SCRIPT="${TRAIN_SCRIPT:-$here/../examples/train_gpt.py}"
TRAIN_COORDINATOR_ARG="${TRAIN_COORDINATOR_ARG-coordinator=}"
TRAIN_RESUME_ARG="${TRAIN_RESUME_ARG-resume=}"
TORCHRUN="${TORCHRUN:-torchrun}"

log() { echo "[torchrun.sh $HOSTNAME node $NODE_RANK] $*" >&2; }

case "$SHADOW_COORDINATOR" in
  tcp://*:*) ;;
  *) log "SHADOW_COORDINATOR=$SHADOW_COORDINATOR is not tcp://HOST:PORT"; exit 2 ;;
esac

if [[ -z "${NPROC_PER_NODE:-}" ]]; then
  NPROC_PER_NODE=1
  if command -v nvidia-smi >/dev/null 2>&1; then
    gpus="$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)"
    if (( gpus > 0 )); then NPROC_PER_NODE="$gpus"; fi
  fi
fi

# CURVE: both files or neither (the trainer hooks read these two variables)
if [[ -n "${SHADOW_CURVE_SERVER_KEY:-}" || -n "${SHADOW_CURVE_CLIENT_KEY:-}" ]]; then
  for var in SHADOW_CURVE_SERVER_KEY SHADOW_CURVE_CLIENT_KEY; do
    if [[ -z "${!var:-}" || ! -r "${!var}" ]]; then
      log "$var='${!var:-}' is not a readable key file; CURVE needs both SHADOW_CURVE_SERVER_KEY (server.key)" \
          "and SHADOW_CURVE_CLIENT_KEY (NAME.key_secret)"
      exit 2
    fi
  done
  export SHADOW_CURVE_SERVER_KEY SHADOW_CURVE_CLIENT_KEY
fi

# This host's address on the way to the coordinator (a UDP connect sends nothing).
route_address() {
  local target="${SHADOW_COORDINATOR#tcp://}"
  python3 - "${target%:*}" <<'EOF'
import socket, sys
family, _, _, _, addr = socket.getaddrinfo(sys.argv[1].strip("[]"), 9, type=socket.SOCK_DGRAM)[0]
with socket.socket(family, socket.SOCK_DGRAM) as s:
    s.connect(addr)
    print(s.getsockname()[0])
EOF
}

SHADOW_METRICS_PORT="${SHADOW_METRICS_PORT-9500}"
if [[ -n "$SHADOW_METRICS_PORT" ]]; then
  # default: loopback only; "auto": this host's own address (never every interface by default)
  SHADOW_METRICS_HOST="${SHADOW_METRICS_HOST:-127.0.0.1}"
  if [[ "$SHADOW_METRICS_HOST" == auto ]]; then
    if ! SHADOW_METRICS_HOST="$(route_address)"; then
      log "SHADOW_METRICS_HOST=auto: no route from this host to $SHADOW_COORDINATOR; set SHADOW_METRICS_HOST"
      exit 2
    fi
  fi
  export SHADOW_METRICS_PORT SHADOW_METRICS_HOST
else
  unset SHADOW_METRICS_PORT
fi

# Is the cluster reachable, and does it hold a checkpoint (memory or a persistence tier)?
# Asked once here, for the log and to fail early; each rank decides again for itself at
# every (re)start. `shadow ls` reaches the coordinator with the CURVE keys above when set.
has_checkpoint() {
  local listing
  local only=()
  if [[ -n "${SHADOW_JOB:-}" ]]; then only=(job="$SHADOW_JOB"); fi
  if ! listing="$(shadow ls source="$SHADOW_COORDINATOR" "${only[@]}" --json)"; then
    log "cannot list the checkpoints of $SHADOW_COORDINATOR (is the shadow cluster up and reachable?)"
    exit 1
  fi
  python3 -c 'import json, sys; sys.exit(0 if any(r.get("state") == "complete" for r in json.load(sys.stdin)) else 1)' \
    <<<"$listing"
}

case "$SHADOW_RESUME" in
  always | true) resume=true ;;
  never | false) resume=false ;;
  auto) resume=auto ;;
  *) log "SHADOW_RESUME=$SHADOW_RESUME: use auto, always or never"; exit 2 ;;
esac
if ! [[ "$TRAIN_MAX_RESTARTS" =~ ^[0-9]+$ ]]; then
  log "TRAIN_MAX_RESTARTS=$TRAIN_MAX_RESTARTS is not a count (0 or more)"
  exit 2
fi
if has_checkpoint; then
  log "the shadow holds a checkpoint$([[ -n "${SHADOW_JOB:-}" ]] && echo " of job $SHADOW_JOB"): resume=$resume"
else
  log "the shadow holds no checkpoint$([[ -n "${SHADOW_JOB:-}" ]] && echo " of job $SHADOW_JOB"): resume=$resume"
fi

# torchrun's rendezvous store shared with the ranks' process group can hand a restarted
# round the previous round's addresses (pytorch/pytorch#135712): keep them apart
export TORCH_DISABLE_SHARE_RDZV_TCP_STORE="${TORCH_DISABLE_SHARE_RDZV_TCP_STORE:-1}"
launch=(--nproc-per-node="$NPROC_PER_NODE" --max-restarts="$TRAIN_MAX_RESTARTS")
if (( NNODES > 1 )); then
  run_id="${SHADOW_RUN_ID:-${SLURM_JOB_ID:-${SHADOW_JOB:-shadow-job}}}"
  launch+=(--nnodes="$NNODES" --node-rank="$NODE_RANK" --rdzv-backend=c10d
           --rdzv-endpoint="$MASTER_ADDR:$MASTER_PORT" --rdzv-id="$run_id")
else
  launch+=(--standalone)
fi

curve="this user's key set"
if [[ -n "${SHADOW_CURVE_CLIENT_KEY:-}" ]]; then curve=on; fi
if [[ "${SHADOW_INSECURE:-}" == 1 ]]; then curve=off; fi
metrics=off
if [[ -n "${SHADOW_METRICS_PORT:-}" ]]; then metrics="$SHADOW_METRICS_HOST:$SHADOW_METRICS_PORT+LOCAL_RANK"; fi
log "$NPROC_PER_NODE ranks, node $NODE_RANK of $NNODES, shadow $SHADOW_COORDINATOR," \
    "metrics $metrics, CURVE $curve, up to $TRAIN_MAX_RESTARTS restarts"
exec "$TORCHRUN" "${launch[@]}" "$TRAIN_SCRIPT" "$TRAIN_COORDINATOR_ARG$SHADOW_COORDINATOR" \
  "$TRAIN_RESUME_ARG$resume" "$@"
