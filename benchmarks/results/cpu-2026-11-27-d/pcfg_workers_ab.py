import time, numpy as np, sys
from flatlm.languages.pcfg import dense_grammar, random_grammar
rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 7
cases = []
rel = random_grammar(0)
c = rel.sample(1024, seed=1); cases.append(("released B1024 (chunks of 64)", rel, c.tokens, c.lengths))
for n, bs in [(256, 16), (4, 4), (4, 2)]:
    g = dense_grammar(0, max_length=32, batch_size=bs)
    toks = g.sample(n, seed=2)
    # full-length sentences as in peers.py
    from flatlm.languages.pcfg.sample import *  # noqa
    cases.append((f"dense T32 B{n} (chunks of {bs})", g, None, n))
import numpy as np
rng = np.random.default_rng(0)
prepared = []
for name, g, toks, lens in cases:
    if toks is None:
        n = lens
        toks = rng.integers(0, g.vocab_size, (n, 32)).astype(np.int32); lens = np.full(n, 32, np.int32)
    prepared.append((name, g, toks, lens))
for name, g, toks, lens in prepared:
    W = g._engine.workers
    outs = {}
    for w in (1, W):
        g._engine.workers = w; outs[w] = g.conditionals(toks, lens)
    same = np.array_equal(outs[1], outs[W])
    t = {1: [], W: []}
    for r in range(rounds):
        for w in (1, W):
            g._engine.workers = w
            s = time.perf_counter(); g.conditionals(toks, lens); t[w].append(time.perf_counter() - s)
    ratio = np.array(t[1]) / np.array(t[W])
    print(f"{name}: 1 worker {len(lens)/np.median(t[1]):.0f} sent/s, {W} workers {len(lens)/np.median(t[W]):.0f} sent/s, "
          f"speed-up {np.median(ratio):.2f}x [{ratio.min():.2f}-{ratio.max():.2f}], bitwise same: {same}", flush=True)
    g._engine.workers = W
