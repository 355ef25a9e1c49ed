"""Third H200 call (2026-11-29): why run2's row-sum check of the HMM's conditionals failed on the GPU.

The HMM kernels' matmuls ran at the default float32 precision, which XLA:GPU may run on TF32 matrix units.
Compares, on 4096 paper-HMM sentences, float32 at default and at "highest" matmul precision, each through
pageable and pinned host memory, with float64 on the same GPU; then the end-to-end rate of 262144 sentences in one
call at both precisions (pinned, 3 calls each after one warm-up). One JSON line per case."""

import json
import os
import time

import jax
import numpy as np

from flatlm.languages.hmm import random_hmm

hmm = random_hmm(seed=0)
h = hmm.sample(4096, seed=1)
with jax.enable_x64(True):
    ref = hmm.conditionals(h.tokens, h.lengths)
valid = h.lengths[:, None] > np.arange(h.tokens.shape[1])
for prec in ("default", "highest"):
    with jax.default_matmul_precision(prec):
        for how in ("pageable", "pinned"):
            os.environ["FLATLM_HOST_TRANSFER"] = how
            q = hmm.conditionals(h.tokens, h.lengths)
            print(json.dumps(dict(precision=prec, transfer=how,
                                  max_rowsum_err=float(np.abs(q.sum(-1)[valid] - 1).max()),
                                  max_abs_err=float(np.abs(q - ref).max()),
                                  max_rel_err=float((np.abs(q - ref) / np.maximum(ref, 1e-30))[ref > 1e-6].max()))),
                  flush=True)
os.environ["FLATLM_HOST_TRANSFER"] = "pinned"
big = hmm.sample(262144, seed=1)
for prec in ("default", "highest"):
    with jax.default_matmul_precision(prec):
        hmm.conditionals(big.tokens, big.lengths)
        ts = []
        for _ in range(3):
            t = time.perf_counter()
            hmm.conditionals(big.tokens, big.lengths)
            ts.append(time.perf_counter() - t)
        print(json.dumps(dict(precision=prec, sent_per_s=[262144 / t for t in ts])), flush=True)
