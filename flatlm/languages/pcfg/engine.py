"""Running the PCFG chart kernels: a per-grammar cache of plans and compiled kernels, length buckets, and a
batch of sentences applied in chunks of similar length.

`Engine` holds one `Plan` per chart size and dtype and one `Compiled` kernel per (kind, size, dtype). Kernels
are compiled ahead of time, several chart sizes at once in threads (`compile_all`), with compiler options that
halve the compile time of these unrolled charts on CPU, and on GPU cut it to a third for charts without wide blocks
(`flatlm.compile_options.CHART_SMALL_DOTS`). On the CPU backend the chunks of a batch run in threads, one per core
(`default_workers`, `apply_chunks`). `encode_tokens` validates a batch and maps it to the leaf table's ids
(pad = V, mask = V + 1).
"""

from __future__ import annotations

import collections
import concurrent.futures
import functools

import jax
import jax.numpy as jnp
import numpy as np

from flatlm.compile_options import CHART, CHART_SMALL_DOTS, chart_options, compile_lowered
from flatlm.cpu_codegen import usable_cpus
from flatlm.languages.base import host_outputs, special_ids, start_host_copy
from flatlm.languages.pcfg.chart import has_wide_blocks
from flatlm.languages.pcfg.kernels import KERNELS, TIME_AXES
from flatlm.languages.pcfg.plan import Plan


class Compiled:
    """A kernel compiled ahead of time per argument shape, with compiler `options` (`flatlm.compile_options`'s
    `CHART` or `CHART_SMALL_DOTS`, as `Engine.fn` chooses) where XLA knows them.

    `prepare` compiles several shapes at once (`compile_all`: XLA's compiles in threads, beside the tracing of the
    next shape), so the few chart sizes one call needs compile in parallel on a multi-core host.
    """

    def __init__(self, fn, options: dict):
        self.jitted = jax.jit(fn)
        self.options = options
        self.executables: dict = {}

    @staticmethod
    def _key(args) -> tuple:
        """(shape, dtype) of every leaf, from the arrays' own attributes: np.result_type on a jax.Array goes through
        a deprecation warning, and dtype.name is slow too: ~2.5 ms a chunk before, for ~115 leaves (the released-shape
        grammar at B1024, 16 chunks: 12.3k -> 15.0k sentences/s; the dense one at B4: 257 -> 283)."""
        return tuple((a.shape, a.dtype) if hasattr(a, "dtype") else (np.shape(a), np.result_type(a))
                     for a in jax.tree.leaves(args))

    def _lower(self, args):
        return self.jitted.lower(*args)

    def _compile(self, lowered):
        """The executable of a `_lower` result (XLA's compile: it releases the GIL, so it may run in a thread)."""
        return compile_lowered(lowered, chart_options(self.options))

    def prepare(self, arg_lists: list) -> None:
        """Compile the shapes of these argument tuples that are not compiled yet (in parallel)."""
        compile_all([(self, args) for args in arg_lists])

    def __call__(self, *args):
        exe = self.executables.get(self._key(args))  # one key a call: ~30 us for the ~115 leaves of a released chart
        if exe is None:
            self.prepare([args])
            exe = self.executables[self._key(args)]
        return exe(*args)


def _with_callers_x64(fn):
    """`fn` for a worker thread: run under the calling thread's jax x64 setting (a thread-local one)."""
    x64 = bool(jax.config.x64_enabled)

    def in_workers(*args):
        with jax.enable_x64(x64):
            return fn(*args)

    return in_workers


def compile_all(pairs: list) -> None:
    """Compile the missing (kernel, arguments) shapes: each traced and lowered in this thread, largest first, and
    handed to a pool of compile threads while the next one is traced.

    Tracing and lowering are Python, under the GIL: in threads of their own, two ran side by side at half speed or
    worse. XLA's compile releases the GIL and overlaps the tracing of the next program. The released-shape grammar's
    first call at B1024 (charts of 8, 12 and 16 words), 2-core Intel VM, 2026-11-29, alternating processes, with
    `chart_small` traced in fewer Python calls: 16.8 / 15.1 / 16.2 s -> 14.8 / 15.1 / 15.1 s, and with JAX's persistent
    compilation cache filled (a later process: XLA's compile is a cache read, tracing is most of what is left)
    6.2 / 5.7 / 6.2 s -> 4.0 / 4.7 / 4.2 s (benchmarks/RESULTS.md)."""
    todo = {}
    for fn, args in pairs:
        shape_key = fn._key(args)
        if shape_key not in fn.executables:
            todo.setdefault((id(fn), shape_key), (fn, args))
    # Largest programs first (longest job first): the largest one no longer waits alone at the end for a thread.
    jobs = sorted(todo.values(), key=lambda job: -sum(np.size(a) for a in jax.tree.leaves(job[1])))
    if len(jobs) <= 1:
        for fn, args in jobs:
            fn.executables[fn._key(args)] = fn._compile(fn._lower(args))
        return
    with concurrent.futures.ThreadPoolExecutor(min(len(jobs), usable_cpus())) as pool:
        compiles = [(fn, args, pool.submit(_with_callers_x64(fn._compile), fn._lower(args))) for fn, args in jobs]
        for fn, args, future in compiles:
            fn.executables[fn._key(args)] = future.result()


def bucket(length: int) -> int:
    """Chart size for a chunk whose longest sentence has `length` words (few sizes -> few compiles).

    1..4 as is, then rounded up to a multiple of 4 up to 16, then to a multiple of 8.
    """
    if length <= 4:
        return length
    if length <= 16:
        return -(-length // 4) * 4
    return -(-length // 8) * 8


def encode_tokens(tokens, lengths, vocab_size: int) -> tuple[np.ndarray, np.ndarray]:
    """Validate tokens int[n, T] and lengths int[n]; return int32 tokens for the leaf table, and int32 lengths.

    Word ids within a sentence must lie in 0..V-1 or be mask (special_ids(V).mask, an unobserved word that
    inference sums over); every position beyond a sentence's length becomes pad.
    """
    tokens = np.asarray(tokens)
    lengths = np.asarray(lengths)
    if tokens.ndim != 2 or lengths.shape != tokens.shape[:1]:
        raise ValueError(f"need tokens [n, T] and lengths [n], got {tokens.shape} and {lengths.shape}")
    lengths = lengths.astype(np.int32)
    T = tokens.shape[1]
    if np.any(lengths < 0) or np.any(lengths > T):
        raise ValueError(f"lengths must lie in 0..{T}")
    V, mask = vocab_size, special_ids(vocab_size).mask
    inside_nT = np.arange(T)[None, :] < lengths[:, None]
    words = tokens[inside_nT]
    if np.any(((words < 0) | (words >= V)) & (words != mask)):
        raise ValueError(f"word ids within each sentence's length must lie in 0..{V - 1} (or be mask = {mask})")
    # Internally row V of the leaf table is pad (zero), row V + 1 mask (the word is summed over).
    tokens = np.where(tokens == mask, V + 1, tokens)
    return np.where(inside_nT, tokens, V).astype(np.int32), lengths


def default_workers() -> int:
    """Chunks `Engine.run` applies at once: on the CPU backend one per core this process may use, elsewhere 1.

    A chart is a chain of hundreds of small dots, one width after the other, which XLA:CPU runs on about one core
    whatever the intra-op pool's size (the dense grammar's chunk of 4 took 14.7 ms pinned to one core, 14.2 on
    two); independent chunks called from threads share the pool and fill the other cores. On an accelerator the
    chunks would share one device and each would hold its own temporaries: not measured, so not done there."""
    return usable_cpus() if jax.default_backend() == "cpu" else 1


def apply_chunks(calls: list, workers: int):
    """Yield each (compiled fn, args) call's outputs as host arrays, in order, with up to `workers` calls
    running at once in threads (XLA releases the GIL) and at most `workers` + 1 submitted and not yet read.
    One worker (accelerators): call i + 1 is dispatched before call i's outputs are read, so the device computes
    while the previous chunk travels to the host (`start_host_copy`)."""
    if workers <= 1 or len(calls) <= 1:
        yield from host_outputs(fn(*args) for fn, args in calls)
        return
    one = _with_callers_x64(lambda call: {k: np.asarray(start_host_copy(v)) for k, v in call[0](*call[1]).items()})
    with concurrent.futures.ThreadPoolExecutor(workers) as pool:
        pending: collections.deque = collections.deque()
        for call in calls:
            pending.append(pool.submit(one, call))
            if len(pending) > workers:
                yield pending.popleft().result()
        while pending:
            yield pending.popleft().result()


class Engine:
    """Exact inference for one grammar (`root[N]`, `binary[N, N, N]`, `emit[N, V]`): plans and compiled
    kernels cached per chart size and dtype (float64 under jax x64, else float32), built on first use.
    `workers`: chunks run at once (None: `default_workers`, asked at the first run, not here: building a grammar
    must not start JAX's backend, e.g. before a multi-host run's `jax.distributed.initialize`)."""

    def __init__(self, root_N, binary_NNN, emit_NV):
        self.root, self.binary, self.emit = root_N, binary_NNN, emit_NV
        self.workers: int | None = None
        self.layout: str | None = None  # the charts' memory layout (`kernels.LAYOUTS`); None: `kernels.default_layout`
        self.vocab_size = int(emit_NV.shape[1])
        self._plans: dict = {}
        self._fns: dict = {}

    def plan(self, T: int) -> Plan:
        """The static plan of a chart of T words in the current default dtype."""
        dtype = jnp.float64 if jax.config.x64_enabled else jnp.float32
        key = (T, np.dtype(dtype).name)
        if key not in self._plans:
            self._plans[key] = Plan(self.root, self.binary, self.emit, T, dtype)
        return self._plans[key]

    def fn(self, kind: str, T: int) -> Compiled:
        """The kernel `kind` (a key of `KERNELS`) for charts of T words, called as fn(plan.consts, ...)."""
        plan = self.plan(T)
        key = (kind, T, plan.dtype.name, self.layout)
        if key not in self._fns:  # GEMM autotuning (GPU) only where batched matmuls gain from it
            options = CHART if has_wide_blocks(plan) else CHART_SMALL_DOTS
            self._fns[key] = Compiled(functools.partial(KERNELS[kind], plan, layout=self.layout), options)
        return self._fns[key]

    def run(self, kind: str, tokens: np.ndarray, lengths: np.ndarray, batch_size: int,
            bucket_lengths: bool) -> dict[str, np.ndarray]:
        """Apply a jitted kernel in chunks of sentences of similar length; outputs in the input order.

        `tokens` int32[n, T] and `lengths` as `encode_tokens` returns them. Chunks hold `batch_size`
        sentences, a partial one padded to it; with `bucket_lengths` the sentences are sorted by length and each
        chunk's chart is sized by `bucket`, else every chart has the tokens' width T (one compile).
        Time axes of the outputs have size max(T, largest chart size used); callers slice them to T.

        Every chunk has the same batch, so each chart size compiles one program, and a sentence's outputs depend
        on its chart size only: not on the other sentences of its call, nor on earlier calls. XLA:CPU picks its
        matmul kernel by the operands' sizes, and kernels for different sizes round differently (a column of
        [10, 100] x [100, M] moved by ~5e-7 relative between M = 96 and M = 4096, 2026-11-29), while at one size
        a column's value does not depend on its place (tests/test_pcfg_layouts.py). A padded row costs ~70 us
        (released grammar) to ~5 ms (dense, 32 words) of compute; a new batch would cost seconds of compile.
        """
        n, T_in = tokens.shape
        order = np.argsort(lengths, kind="stable") if bucket_lengths else np.arange(n)
        chunks = [order[a: a + batch_size] for a in range(0, n, batch_size)]
        if bucket_lengths:
            sizes = [bucket(max(int(lengths[idx].max()), 1)) for idx in chunks]
        else:
            sizes = [max(T_in, 1)] * len(chunks)
        T_max = max([T_in, *sizes])
        calls = []
        B = batch_size
        for idx, T in zip(chunks, sizes):
            tok_BT = np.full((B, T), self.vocab_size, np.int32)  # pad id = V
            width = min(T, T_in)
            tok_BT[: len(idx), :width] = tokens[idx, :width]
            len_B = np.zeros(B, np.int32)
            len_B[: len(idx)] = lengths[idx]
            calls.append((idx, self.fn(kind, T), (self.plan(T).consts, tok_BT, len_B)))
        compile_all([(fn, args) for _, fn, args in calls])  # every chart size first, in parallel
        results: dict[str, np.ndarray] = {}
        outputs = apply_chunks([(fn, args) for _, fn, args in calls], self.workers or default_workers())
        for (idx, _, _), out in zip(calls, outputs):
            for k, v in out.items():
                v = v[: len(idx)]
                axes = TIME_AXES.get(k, ())
                if k not in results:
                    shape = [T_max if ax in axes else s for ax, s in enumerate(v.shape)][1:]
                    results[k] = np.zeros([n, *shape], v.dtype)
                results[k][(idx, *(slice(0, s) for s in v.shape[1:]))] = v
        return results

    def length_distribution(self, L: int) -> np.ndarray:
        """float[L+1]: P(length = l) for l = 0..L, by one inside pass over all-ones leaves (emit.sum(1))."""
        plan = self.plan(L)
        fn = self.fn("lengths", L)
        leaf_1TN = jnp.broadcast_to(plan.consts["leaf_total"], (1, L, plan.N))
        z_1T, log_scale_1T, leaf_log_1T = (np.asarray(a[0], np.float64) for a in fn(plan.consts, leaf_1TN))
        p = z_1T * np.exp(log_scale_1T + np.cumsum(leaf_log_1T))
        return np.concatenate([[0.0], p])
