#!/usr/bin/env bash
# Runs on each TPU worker (from launch/tpu.sh setup): a venv with flatlm and JAX for TPU. Idempotent.
# flatlm needs Python >= 3.11; the TPU images' python3 is older (3.10 on tpu-ubuntu2204-base), so a Python 3.11 is
# fetched with uv (https://docs.astral.sh/uv/) unless one is already there. A .venv on an older Python is replaced.
# FLATLM_DRY_RUN=1 prints the commands that change something instead of running them.
set -euo pipefail
cd "$(dirname "$0")/.."
source launch/common.sh
dry=${FLATLM_DRY_RUN:-0}
py=$(find_python) || py=""
if [ -z "$py" ]; then
  run sh -c 'command -v uv > /dev/null || [ -x "$HOME/.local/bin/uv" ] || curl -LsSf https://astral.sh/uv/install.sh | sh'
  uv=$(command -v uv || echo "$HOME/.local/bin/uv")
  run "$uv" python install 3.11
  if [ "$dry" = 1 ]; then py="\$($uv python find 3.11)"; else py=$("$uv" python find 3.11); fi
fi
if [ -x .venv/bin/python ] && ! python_ok .venv/bin/python; then run rm -rf .venv; fi
[ -x .venv/bin/python ] && [ "$dry" != 1 ] || run "$py" -m venv .venv
run .venv/bin/pip install --quiet --upgrade pip
run .venv/bin/pip install --quiet -e ".[gcs]" "jax[tpu]>=0.10,<0.11"
run .venv/bin/python -c "import jax; print(jax.process_index(), jax.device_count(), jax.devices()[0].platform)"
