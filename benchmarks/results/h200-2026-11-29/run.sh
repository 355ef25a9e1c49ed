#!/bin/bash
# The one device call of 2026-11-29 (H200), from the repo root: `bash benchmarks/results/h200-2026-11-29/run.sh`,
# with the wheels of flatlm's missing dependencies in .whl (carried). Most important first; each part has its own
# time limit, and every part's output lands under $OUT as it is made.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  || exit 1
export PYTHONPATH=/tmp/site:. PYTHONUNBUFFERED=1 TF_CPP_MIN_LOG_LEVEL=2
R=benchmarks/results/h200-2026-11-29
{ echo "commit ${COMMIT:-unknown}"; nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,memory.total \
  --format=csv; nproc; python3 -m pip list 2>/dev/null | grep -iE "^(jax|jaxlib|flax|optax|numpy|torch|orbax)"; } \
  > "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"
echo "== 1. HMM and the released PCFG (symbol minor), both host transfers"
timeout 240 python3 benchmarks/gpu.py --no-mlm --conditionals hmm,pcfg-released --layouts symbol_minor \
  --out "$OUT/transfers.json" 2>&1 | grep -v "^W[0-9]" | tee "$OUT/log.txt"
echo "== 2. ceilings: torch device-to-host, pinned allocation, host memcpy" | tee -a "$OUT/log.txt"
timeout 40 python3 $R/d2h.py 2>&1 | tee -a "$OUT/log.txt"
echo "== 3. the bare train step, L12-H768 B4096 bf16 dropout" | tee -a "$OUT/log.txt"
timeout 80 python3 -c "import sys, json; sys.path.insert(0, 'benchmarks'); import gpu
print('STEP', json.dumps(gpu.flatlm_step('L12-H768', 4096, 'bfloat16', True, 3, 10)))" 2>&1 | tail -3 | tee -a "$OUT/log.txt"
echo "== 4. flatlm train, pcfg paper preset, stream source, 120 steps" | tee -a "$OUT/log.txt"
timeout 150 python3 -m flatlm.cli train --config configs/pcfg_mlm.py:paper --config.data.source=stream \
  --config.train.steps=120 --config.data.eval_size=1024 --config.train.eval_every=1000000 \
  --config.checkpoint.every=1000000 --config.train.log_every=20 --workdir /tmp/wtrain 2>&1 \
  | tr '\r' '\n' | grep -v "^\s*$" | grep -v "^W[0-9]" | tail -12 | tee -a "$OUT/log.txt"
cp /tmp/wtrain/metrics.jsonl "$OUT/train_metrics.jsonl" 2>/dev/null
grep -o '"step": [0-9]*\|"train/steps_per_sec": [0-9.]*\|"time/[a-z_]*": [0-9.]*' /tmp/wtrain/metrics.jsonl 2>/dev/null \
  | paste -sd' ' | tee -a "$OUT/log.txt"
echo "== 5. the released PCFG, batch minor" | tee -a "$OUT/log.txt"
timeout 60 python3 benchmarks/gpu.py --no-mlm --conditionals pcfg-released --layouts batch_minor \
  --transfers pageable --out "$OUT/batch_minor.json" 2>&1 | grep -v "^W[0-9]" | tee -a "$OUT/log.txt"
