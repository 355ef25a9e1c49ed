#!/usr/bin/env bash
# Single- or multi-GPU host: install flatlm and JAX with CUDA into .venv and train on all local GPUs.
#   launch/gpu.sh [--dry-run] CONFIG WORKDIR [--config.x=y ...]
# A .venv without a CUDA JAX (e.g. made for CPU tests) gets jax[cuda12] installed into it; a .venv on Python
# older than 3.11 is replaced. --dry-run prints the commands instead of running them.
set -euo pipefail
cd "$(dirname "$0")/.."
source launch/common.sh
dry=${FLATLM_DRY_RUN:-0}
if [ "${1:-}" = "--dry-run" ]; then dry=1; shift; fi
config=${1:?usage: launch/gpu.sh [--dry-run] CONFIG WORKDIR [--config.x=y ...]}
workdir=${2:?workdir}
if [ -x .venv/bin/python ] && ! python_ok .venv/bin/python; then run rm -rf .venv; fresh=1; fi
if [ ! -x .venv/bin/python ] || [ "${fresh:-0}" = 1 ]; then
  py=$(find_python) || { echo "launch/gpu.sh: no Python >= 3.11 found; install one (e.g. uv python install 3.11)" >&2
                         exit 2; }
  run "$py" -m venv .venv
  fresh=1
fi
# a .venv made for CPU (tests) has a JAX without CUDA: install jax[cuda12] into it too
if [ "${fresh:-0}" = 1 ] || ! .venv/bin/python -c 'import jax, sys; sys.exit(jax.default_backend() != "gpu")' 2> /dev/null
then
  run .venv/bin/pip install -q -e ".[gcs]" "jax[cuda12]>=0.10,<0.11"
fi
run .venv/bin/flatlm train --config "$config" --workdir "$workdir" "${@:3}"
