#!/usr/bin/env bash
# Run flatlm on a Cloud TPU VM slice (v4 / v5e pod slices): create it, copy the code, install on every worker,
# start training detached (nohup, logs on each worker), follow the logs, delete. See launch/README.md.
#
#   launch/tpu.sh [--dry-run] create  NAME ZONE [ACCELERATOR=v4-32] [VERSION=tpu-ubuntu2204-base]
#   launch/tpu.sh [--dry-run] setup   NAME ZONE           # copy this checkout to all workers and install it
#   launch/tpu.sh [--dry-run] train   NAME ZONE CONFIG WORKDIR [--config.x=y ...]   # WORKDIR: gs://bucket/run
#   launch/tpu.sh [--dry-run] experiment NAME ZONE CONFIG WORKDIR [ACCELERATOR=v4-8] [--config.x=y ...]
#                                     # one slice NAME-<run> per run of the experiment, each job detached
#   launch/tpu.sh [--dry-run] logs    NAME ZONE [JOB=train]  # the last lines of worker 0's log
#   launch/tpu.sh [--dry-run] ssh     NAME ZONE 'command'  # any command on all workers
#   launch/tpu.sh [--dry-run] delete  NAME ZONE
#
# --dry-run (or FLATLM_DRY_RUN=1) prints the gcloud commands instead of running them.
# `train` passes --config.mesh.multihost=True, so every worker calls jax.distributed.initialize(), reads only
# its shard of each batch and writes checkpoints together (orbax). The job runs under nohup with its output in
# ~/flatlm-logs/JOB.log on every worker, so a closed ssh session does not stop it. Rerunning `train` resumes from
# WORKDIR. Preemptible slices send SIGTERM before stopping: flatlm saves a checkpoint and exits; `train` resumes.
set -euo pipefail

dry=${FLATLM_DRY_RUN:-0}
if [ "${1:-}" = "--dry-run" ]; then dry=1; shift; fi

cmd=${1:?usage: launch/tpu.sh [--dry-run] create|setup|train|experiment|logs|ssh|delete NAME ZONE ...}
name=${2:?TPU name}
zone=${3:?zone, e.g. us-central2-b (v4) or us-west4-a (v5e)}
shift 3
here=$(cd "$(dirname "$0")/.." && pwd)
source "$here/launch/common.sh"

on_all() {  # on_all SLICE COMMAND
  run gcloud compute tpus tpu-vm ssh "$1" --zone "$zone" --worker=all --command "$2"
}

create() {  # create SLICE ACCEL VERSION
  run gcloud compute tpus tpu-vm create "$1" --zone "$zone" --accelerator-type "$2" --version "$3"
}

setup() {  # setup SLICE
  local tarball
  tarball=$(mktemp -t flatlm.XXXXXX.tgz)
  git -C "$here" archive --format=tar.gz -o "$tarball" HEAD
  run gcloud compute tpus tpu-vm scp "$tarball" "$1":~/flatlm.tgz --zone "$zone" --worker=all
  on_all "$1" "mkdir -p ~/flatlm && tar -xzf ~/flatlm.tgz -C ~/flatlm && cd ~/flatlm && bash launch/worker_setup.sh"
  rm -f "$tarball"
}

detached() {  # detached SLICE JOB FLATLM-ARGS...: start `flatlm ARGS` on every worker under nohup, log to a file
  local slice=$1 job=$2
  shift 2
  local args="" a
  for a in "$@"; do args+="$(quote "$a") "; done
  on_all "$slice" "mkdir -p ~/flatlm-logs && cd ~/flatlm && nohup .venv/bin/flatlm ${args% } > ~/flatlm-logs/$job.log 2>&1 < /dev/null & echo started $job on \$(hostname), log ~/flatlm-logs/$job.log"
}

case "$cmd" in
  create)
    create "$name" "${1:-v4-32}" "${2:-tpu-ubuntu2204-base}"
    ;;
  setup)
    setup "$name"
    ;;
  train)
    config=${1:?config, e.g. configs/hmm_mlm.py:paper}
    workdir=${2:?workdir, e.g. gs://bucket/hmm}
    shift 2
    detached "$name" train train --config "$config" --workdir "$workdir" --config.mesh.multihost=True "$@"
    echo "follow it: launch/tpu.sh logs $name $zone train" >&2
    ;;
  experiment)
    config=${1:?experiment config, e.g. configs/experiments/fig2_model_sizes.py:paper}
    workdir=${2:?workdir, e.g. gs://bucket/fig2}
    shift 2
    accel=v4-8
    if [ $# -gt 0 ] && [ "${1#--}" = "$1" ]; then accel=$1; shift; fi
    runs=$(cd "$here" && "${FLATLM:-flatlm}" experiment --config "$config" --list "$@")
    for r in $runs; do
      slice="$name-$(echo "$r" | tr 'A-Z_.' 'a-z--')"
      create "$slice" "$accel" tpu-ubuntu2204-base
      setup "$slice"
      detached "$slice" "experiment-$r" experiment --config "$config" --workdir "$workdir" --run "$r" \
        --config.base.mesh.multihost=True "$@"
    done
    ;;
  logs)
    run gcloud compute tpus tpu-vm ssh "$name" --zone "$zone" --worker=0 --command "tail -n 50 ~/flatlm-logs/${1:-train}.log"
    ;;
  ssh)
    on_all "$name" "${1:?command}"
    ;;
  delete)
    run gcloud compute tpus tpu-vm delete "$name" --zone "$zone" --quiet
    ;;
  *)
    echo "unknown command $cmd; use create|setup|train|experiment|logs|ssh|delete" >&2
    exit 2
    ;;
esac
