#!/usr/bin/env bash
# Runs on each TPU worker (from launch/tpu.sh setup): a venv with flatlm and JAX for TPU. Idempotent.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m venv .venv
.venv/bin/pip install --quiet --upgrade pip
.venv/bin/pip install --quiet -e . "jax[tpu]>=0.10,<0.11"
.venv/bin/python -c "import jax; print(jax.process_index(), jax.device_count(), jax.devices()[0].platform)"
