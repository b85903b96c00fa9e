#!/usr/bin/env bash
# Make the shadow cluster's CURVE key pairs, one per role, and store them as the Secrets the
# manifests mount. Run it once before `kubectl apply -k deploy/k8s/base` (or .../persist),
# from a host with `shadow` and `kubectl` (the current context and namespace; NAMESPACE=...
# picks another):
#
#     deploy/k8s/make-keys.sh [KEYS_DIR]        (default: SHADOW_KEYS, else ./shadow-keys)
#
# KEYS_DIR (made 0700; one owned by another user is refused) keeps every pair:
#   server.key, server.key_secret      the cluster's pair (coordinator and workers bind with it)
#   workers/worker.key_secret          the workers' own pair
#   trainers/trainer.key_secret        the trainer pods'
#   clients/client.key_secret          read-only clients: the shadow-client pod (status, ls, restore)
#   admins/admin.key_secret            the operator's (a Secret of its own, mounted nowhere)
# A pair that exists is kept, so running the script again only refreshes the Secrets; delete
# a pair's files to replace it (then `kubectl rollout restart` the pods that mount it, and
# the coordinator and workers, which read the allow lists at start). The Secrets hold
# everything the cluster needs: KEYS_DIR can be deleted afterwards, or kept private.
#
# Secrets (each pod mounts only its own; deploy/k8s/README.md):
#   shadow-server-key    server.key, server.key_secret             coordinator, workers
#   shadow-allow-keys    worker.key, trainer.key, client.key,      coordinator, workers: one
#                        admin.key (public)                        allow directory per role
#   shadow-worker-key    worker.key_secret                         workers
#   shadow-trainer-key   server.key, trainer.key_secret            trainer Job
#   shadow-client-key    server.key, client.key_secret             shadow-client
#   shadow-admin-key     server.key, admin.key_secret              none by default
set -euo pipefail

keys="${1:-${SHADOW_KEYS:-shadow-keys}}"
ns=()
if [[ -n "${NAMESPACE:-}" ]]; then ns=(--namespace="$NAMESPACE"); fi

log() { echo "[make-keys] $*" >&2; }

command -v shadow >/dev/null || { log "shadow is not on PATH (pip install shadow-checkpoint)"; exit 1; }
command -v kubectl >/dev/null || { log "kubectl is not on PATH"; exit 1; }

have_pair() { [[ -s "$1/$2.key" && -s "$1/$2.key_secret" ]]; }  # DIR NAME
(
  umask 077  # the subdirectories keygen makes are private too
  mkdir -p "$keys"
  if [[ ! -O "$keys" ]]; then log "$keys belongs to another user; give a directory of yours"; exit 1; fi
  chmod 0700 "$keys"
  # overwrite=true only replaces a half-written pair (one file without the other)
  have_pair "$keys" server || shadow keygen role=server dir="$keys" name=server overwrite=true
  have_pair "$keys/workers" worker || shadow keygen role=worker dir="$keys/workers" name=worker overwrite=true
  have_pair "$keys/trainers" trainer || shadow keygen role=trainer dir="$keys/trainers" name=trainer overwrite=true
  have_pair "$keys/clients" client || shadow keygen role=client dir="$keys/clients" name=client overwrite=true
  have_pair "$keys/admins" admin || shadow keygen role=admin dir="$keys/admins" name=admin overwrite=true
) >/dev/null

# NAME FILE...: create the generic Secret NAME from FILEs (each under its file name), or update it
secret() {
  local name="$1" from=() f
  shift
  for f in "$@"; do from+=(--from-file="$f"); done
  kubectl "${ns[@]}" create secret generic "$name" "${from[@]}" --dry-run=client -o yaml \
    | kubectl "${ns[@]}" apply -f -
}

secret shadow-server-key "$keys/server.key" "$keys/server.key_secret"
secret shadow-allow-keys "$keys/workers/worker.key" "$keys/trainers/trainer.key" "$keys/clients/client.key" \
  "$keys/admins/admin.key"
secret shadow-worker-key "$keys/workers/worker.key_secret"
secret shadow-trainer-key "$keys/server.key" "$keys/trainers/trainer.key_secret"
secret shadow-client-key "$keys/server.key" "$keys/clients/client.key_secret"
secret shadow-admin-key "$keys/server.key" "$keys/admins/admin.key_secret"
log "Secrets made from $keys (private: 0700); next: kubectl apply -k deploy/k8s/base"
