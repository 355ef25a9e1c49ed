#!/usr/bin/env bash
# Run flatlm on a Cloud TPU VM slice: create it, copy the code, install on every worker, train, delete.
#
#   launch/tpu.sh create  NAME ZONE [ACCELERATOR=v4-32] [VERSION=tpu-ubuntu2204-base]
#   launch/tpu.sh setup   NAME ZONE                 # copy this checkout to all workers and install it
#   launch/tpu.sh train   NAME ZONE CONFIG WORKDIR [--config.x=y ...]   # WORKDIR: a gs:// path or local dir
#   launch/tpu.sh ssh     NAME ZONE 'command'       # any command on all workers
#   launch/tpu.sh delete  NAME ZONE
#
# `train` passes --config.mesh.multihost=True, so every worker calls jax.distributed.initialize(), reads only
# its shard of each batch and writes checkpoints together (orbax). Rerunning `train` resumes from WORKDIR.
# Preemptible slices send SIGTERM before stopping: flatlm saves a checkpoint and exits; `train` again resumes.
set -euo pipefail

cmd=${1:?usage: launch/tpu.sh create|setup|train|ssh|delete NAME ZONE ...}
name=${2:?TPU name}
zone=${3:?zone, e.g. us-central2-b}
shift 3

on_all() {
  gcloud compute tpus tpu-vm ssh "$name" --zone "$zone" --worker=all --command "$1"
}

case "$cmd" in
  create)
    accel=${1:-v4-32}
    version=${2:-tpu-ubuntu2204-base}
    gcloud compute tpus tpu-vm create "$name" --zone "$zone" --accelerator-type "$accel" --version "$version"
    ;;
  setup)
    here=$(cd "$(dirname "$0")/.." && pwd)
    tarball=$(mktemp -t flatlm.XXXXXX.tgz)
    git -C "$here" archive --format=tar.gz -o "$tarball" HEAD
    gcloud compute tpus tpu-vm scp "$tarball" "$name":~/flatlm.tgz --zone "$zone" --worker=all
    on_all "mkdir -p ~/flatlm && tar -xzf ~/flatlm.tgz -C ~/flatlm && cd ~/flatlm && bash launch/worker_setup.sh"
    rm -f "$tarball"
    ;;
  train)
    config=${1:?config, e.g. configs/hmm_mlm.py:paper}
    workdir=${2:?workdir}
    shift 2
    on_all "cd ~/flatlm && .venv/bin/flatlm train --config $config --workdir $workdir --config.mesh.multihost=True $*"
    ;;
  ssh)
    on_all "${1:?command}"
    ;;
  delete)
    gcloud compute tpus tpu-vm delete "$name" --zone "$zone" --quiet
    ;;
  *)
    echo "unknown command $cmd; use create|setup|train|ssh|delete" >&2
    exit 2
    ;;
esac
