#!/usr/bin/env bash
# Single- or multi-GPU host: install JAX with CUDA into .venv and train on all local GPUs.
#   launch/gpu.sh CONFIG WORKDIR [--config.x=y ...]
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x .venv/bin/flatlm ] || { python3 -m venv .venv && .venv/bin/pip install -q -e . "jax[cuda12]>=0.10,<0.11"; }
exec .venv/bin/flatlm train --config "${1:?config}" --workdir "${2:?workdir}" "${@:3}"
