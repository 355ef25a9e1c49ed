"""The exact-conditionals rows of `benchmarks/gpu.py` (issue 17's GPU goals): the released-shape and a dense PCFG,
and the paper's HMM, end to end through the public API (host arrays out), with each host transfer; and the timing
helper both halves use. Run through gpu.py (`--conditionals`, `--transfers`, `--layouts`); results for a device
go in benchmarks/RESULTS.md."""

from __future__ import annotations

import os
import time

import jax
import numpy as np

from flatlm.languages import hmm as hmm_lib
from flatlm.languages.base import HOST_TRANSFER_ENV, start_host_copy
from flatlm.languages.hmm import random_hmm
from flatlm.languages.pcfg import dense_grammar, random_grammar


def median_time(fn, rounds: int, per_round: int) -> float:
    """Median over `rounds` of the wall seconds per call of `per_round` back-to-back calls (fn syncs itself
    only when told: fn(sync) must block iff sync)."""
    fn(True)
    out = []
    for _ in range(rounds):
        t = time.perf_counter()
        for i in range(per_round):
            fn(i == per_round - 1)
        out.append((time.perf_counter() - t) / per_round)
    return float(np.median(out))


def throughput(call, n: int, rounds: int = 5) -> dict:
    """Sentences/s of a blocking call on n sentences (median of `rounds` after a compiling first call)."""
    t = time.perf_counter()
    call()
    first = time.perf_counter() - t
    sec = median_time(lambda sync: call(), rounds, 1)
    return dict(sentences=n, seconds=sec, sentences_per_s=n / sec, compile_s=max(first - sec, 0.0))


def shown(name: str, row: dict) -> dict:
    """{name: row}, printed at once (a run cut off by its time limit still shows the rows it measured)."""
    print(f"  {name}: {row['sentences_per_s']:,.0f} sent/s, compile {row['compile_s']:.1f} s", flush=True)
    return {name: row}


def per_chunk(make_row, chunks: list[int]) -> dict:
    """{row: result} of make_row(chunk) for each chunk size; a chunk that fails (out of memory) is an error row
    and the others still run (the sweep that a backend-aware default chunk would be read from)."""
    rows = {}
    for chunk in chunks:
        try:
            rows.update(make_row(chunk))
        except Exception as e:  # noqa: BLE001 - recorded, the next chunk size still runs
            rows[f"chunk {chunk}"] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
    return rows


def with_transfer(how: str, call):
    """call() with $FLATLM_HOST_TRANSFER = how (read by the library at each call), restored after."""
    before = os.environ.get(HOST_TRANSFER_ENV)
    os.environ[HOST_TRANSFER_ENV] = how
    try:
        return call()
    finally:
        if before is None:
            del os.environ[HOST_TRANSFER_ENV]
        else:
            os.environ[HOST_TRANSFER_ENV] = before


def pcfg_released_row(small: bool, chunks: list[int] | None = None, transfers=("pageable",),
                      layouts=None) -> dict:
    """{row: result} for the released-shape PCFG (`random_grammar(0)`), end to end (host arrays out), at each
    inference chunk size (default 4096), host transfer and chart layout (default both; the batch-minor one is the
    CPU's default, the symbol-minor one an accelerator's: `kernels.default_layout`)."""
    n_pcfg = 256 if small else 16384
    layouts = layouts or (("batch_minor",) if small else ("symbol_minor", "batch_minor"))

    def one(chunk, layout):
        g = random_grammar(0, batch_size=chunk)
        g._engine.layout = layout
        c = g.sample(n_pcfg, seed=1)
        out = {}
        for how in transfers:
            out.update(shown(f"pcfg released-shape, chunk {chunk}, {layout}, {how}", with_transfer(
                how, lambda: throughput(lambda: g.conditionals(c.tokens, c.lengths), n_pcfg))))
        return out

    def row(chunk):
        out = {}
        for layout in layouts:
            out.update(one(chunk, layout))
        return out

    return per_chunk(row, chunks or [256 if small else 4096])


def pcfg_dense_row(small: bool, chunks: list[int] | None = None) -> dict:
    """{row: result} for a dense N=50 PCFG at T=32, end to end (host arrays out), at each chunk size (default
    512)."""
    n_dense = 64 if small else 2048
    vocab = dense_grammar(0, max_length=32).vocab_size
    toks = np.random.default_rng(0).integers(0, vocab, (n_dense, 32)).astype(np.int32)  # the same for every chunk

    def row(chunk):
        d = dense_grammar(0, max_length=32, batch_size=min(n_dense, chunk))
        return {f"pcfg dense N=50 T=32, chunk {d.batch_size}": throughput(
            lambda: d.conditionals(toks, np.full(n_dense, 32)), n_dense)}

    return per_chunk(row, chunks or [512])


def hmm_rows(small: bool, transfers=("pageable",)) -> dict:
    """The paper's HMM end to end (host arrays out) at the default chunk, a larger one and in one call, with each
    host transfer; the raw device-to-host bandwidth of one chunk's conditionals; the kernel on device alone."""
    rows = {}
    hmm = random_hmm(seed=0)
    n_hmm, hchunk = (1024, 256) if small else (262144, 65536)
    h = hmm.sample(n_hmm, seed=1)
    calls = lambda: [hmm.conditionals(h.tokens[a:a + 1024], h.lengths[a:a + 1024])  # noqa: E731
                     for a in range(0, n_hmm, 1024)]
    for how in transfers:
        for chunk in [None, *sorted({hmm_lib._CHUNK, hchunk, n_hmm})]:  # the default, the CPU's, GPU-sized, all
            rows.update(shown(f"hmm K=100 V=200 T=16, chunk {chunk or 'default'}, {how}", with_transfer(
                how, lambda c=chunk: throughput(lambda: hmm.conditionals(h.tokens, h.lengths, chunk_size=c), n_hmm))))
        # the dataset builder's pattern: one call per `builder.CHUNK` (1024) sentences, each its own host array
        rows.update(shown(f"hmm K=100 V=200 T=16, calls of 1024 sentences, {how}",
                          with_transfer(how, lambda: throughput(calls, n_hmm))))
    # The kernel alone on device-resident inputs, output left on the device: what an on-device consumer (the
    # exact-loss evaluator's KL) sees, without the [n, T, V] float32 copy to the host (12.8 kB a sentence).
    params = hmm._params()
    tok, lens = jax.device_put(h.tokens[:hchunk]), jax.device_put(h.lengths[:hchunk])
    q = hmm_lib._conditionals_fn(*params, tok, lens).block_until_ready()
    for how in transfers:  # bytes of one chunk of q to numpy: GB/s = sentences/s * 12.8 kB
        r = with_transfer(how, lambda: throughput(lambda: np.asarray(start_host_copy(q + 0)), hchunk))
        gb_per_s = r["sentences_per_s"] * q.nbytes / q.shape[0] / 1e9
        rows[f"hmm chunk {hchunk} of q to numpy alone, {how}"] = {**r, "gb_per_s": gb_per_s}
    rows[f"hmm kernel on device, batch {hchunk}"] = throughput(
        lambda: hmm_lib._conditionals_fn(*params, tok, lens).block_until_ready(), hchunk)
    return rows
