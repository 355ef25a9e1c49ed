#!/bin/bash
# The second device call of 2026-11-29 (H200), after run.sh: the library's new accelerator defaults (pinned host
# transfer, the HMM's chunk of 2^18) as a user gets them, the first whole `flatlm train` on a GPU, and the
# released PCFG's two chart layouts through pinned memory. Wheels in .whl (carried), as run.sh.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  || exit 1
export PYTHONPATH=/tmp/site:. PYTHONUNBUFFERED=1 TF_CPP_MIN_LOG_LEVEL=2
echo "commit ${COMMIT:-unknown}" | tee "$OUT/log2.txt"
echo "== 1. defaults, no FLATLM_HOST_TRANSFER: the paper HMM, 262144 sentences in one call, 5 timed calls" | tee -a "$OUT/log2.txt"
timeout 60 python3 -c "
import time, numpy as np
from flatlm.languages.base import host_transfer
from flatlm.languages.hmm import random_hmm
hmm = random_hmm(seed=0); h = hmm.sample(262144, seed=1)
q = hmm.conditionals(h.tokens, h.lengths)
ts = []
for _ in range(5):
    t = time.perf_counter(); q = hmm.conditionals(h.tokens, h.lengths); ts.append(time.perf_counter() - t)
print('transfer', host_transfer(), 'shape', q.shape, 'row sums ok', bool(np.allclose(q.sum(-1)[h.lengths[:, None] > np.arange(16)], 1, atol=1e-4)))
print('DEFAULTS sent/s median', 262144 / np.median(ts), 'min-max', 262144 / max(ts), 262144 / min(ts))
" 2>&1 | grep -v "^W[0-9]" | tee -a "$OUT/log2.txt"
echo "== 2. gpu.py HMM rows, pinned" | tee -a "$OUT/log2.txt"
timeout 80 python3 benchmarks/gpu.py --no-mlm --conditionals hmm --transfers pinned --out "$OUT/hmm2.json" 2>&1 \
  | grep -v "^W[0-9]" | grep "^  \|GB/s\|kernel\|FAILED\|Error" | tee -a "$OUT/log2.txt"
echo "== 3. flatlm train, pcfg paper preset, stream source, 120 steps" | tee -a "$OUT/log2.txt"
timeout 170 python3 -m flatlm.cli train --config configs/pcfg_mlm.py:paper --config.data.source=stream \
  --config.train.steps=120 --config.data.eval_size=1024 --config.train.eval_every=1000000 \
  --config.checkpoint.every=1000000 --config.train.log_every=20 --workdir /tmp/wtrain 2>&1 \
  | tr '\r' '\n' | grep -v "^\s*$" | grep -v "^W[0-9]" | tail -8 | tee -a "$OUT/log2.txt"
cp /tmp/wtrain/metrics.jsonl "$OUT/train_metrics.jsonl" 2>/dev/null
grep -o '"step": [0-9]*\|"train/steps_per_sec": [0-9.]*\|"time/[a-z_]*": [0-9.]*' /tmp/wtrain/metrics.jsonl 2>/dev/null \
  | paste -sd' ' | tee -a "$OUT/log2.txt"
echo "== 4. the released PCFG, both layouts, pinned" | tee -a "$OUT/log2.txt"
timeout 110 python3 benchmarks/gpu.py --no-mlm --conditionals pcfg-released --transfers pinned \
  --out "$OUT/pcfg2.json" 2>&1 | grep -v "^W[0-9]" | grep "^  \|FAILED\|Error" | tee -a "$OUT/log2.txt"
