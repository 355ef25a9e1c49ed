"""XLA compiler options for programs whose compile time outweighs their run time on the CPU backend.

XLA:CPU compiles with its newer fusion emitters and LLVM -O3 by default. Two kinds of flatlm program pay for that
in seconds of compile and get nothing back:
- `CHART`: the PCFG chart kernels, unrolled over widths into hundreds of small fusions: the fusion emitters off and
  LLVM -O2 about halve their compile time, for no measurable speed (`flatlm.languages.pcfg.engine`).
  `CHART_SMALL_DOTS` adds XLA:GPU's GEMM autotuning off, for charts without wide blocks (a third of the compile
  time on an H100; see below).
- `ONE_SHOT`: programs a process runs once, the parameter initialisation above all. Compiling the tiny config's
  init (params and AdamW state) took 1.06-1.15 s with XLA's defaults and 0.38-0.43 s with these; the L6-H256
  init 2.8 -> 2.0 s, its single run 22 -> 47 ms (2-core AMD EPYC, one process, first compiles). LLVM -O1, not -O0:
  at -O0 the drawn floats differed from the default build's in the last bit (7e-9: a seed would no longer give
  the initial parameters it gave before), at -O1 every parameter and optimizer leaf is bitwise the same (tiny
  PCFG, HMM, OPT, cpu PCFG and L6-H256 BERT configs; `tests/test_train.py` checks the tiny one).

The train and evaluation steps keep XLA's defaults: they run thousands of times, and with the fusion emitters off
the L4-H128 train step compiled slower (3.0 -> 4.5 s), not faster. `compile_ahead` compiles one in a thread while
the caller does other work (the train loop: while the state initialises).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import os

import jax

from flatlm.errors import UserError

CHART = {"xla_cpu_use_fusion_emitters": False, "xla_backend_optimization_level": 2}
# XLA:GPU autotunes every dot by compiling candidate kernels for it. A chart of small blocks has many small dots that
# gain nothing from it: on an H100 (jax 0.11.2, one run each, 2026-11-27) the released-shape grammar compiled in
# 20.3 s instead of 60.9 s with autotuning off and ran 81.2k vs 83.6k sentences/s, while the dense N=50 grammar,
# whose wide blocks are batched matmuls, ran 2.7x slower without it (6.9k vs 18.4k): those keep `CHART`. The
# backends ignore each other's options, so either dict is right on any backend.
CHART_SMALL_DOTS = CHART | {"xla_gpu_autotune_level": 0}
# $FLATLM_CHART_XLA_LEVEL (0-3) replaces the charts' LLVM level: `make test` sets 0, its charts being small and each
# compiled once (test_pcfg.py 74-91 -> 56-57 s, one process, Intel model-85 VM, 2026-11-29). Unset: `CHART`'s 2.
CHART_LEVEL_ENV = "FLATLM_CHART_XLA_LEVEL"
ONE_SHOT = {"xla_cpu_use_fusion_emitters": False, "xla_backend_optimization_level": 1}

_unknown: set[str] = set()  # option names this XLA rejected: not passed again


def compile_lowered(lowered, options: dict):
    """`lowered.compile` with `options`, or without those this XLA does not know (a newer or older jaxlib)."""
    options = {k: v for k, v in options.items() if k not in _unknown}
    while True:
        try:
            return lowered.compile(compiler_options=options or None)
        except jax.errors.JaxRuntimeError as e:  # "No such compile option: 'NAME'"; a bad value is a bug: raised
            name = next((k for k in options if f"'{k}'" in str(e)), None)
            if "No such compile option" not in str(e) or name is None:
                raise
            _unknown.add(name)
            del options[name]


def chart_options(options: dict) -> dict:
    """A chart's `options` with the LLVM level $FLATLM_CHART_XLA_LEVEL names, where it is set."""
    level = os.environ.get(CHART_LEVEL_ENV, "")
    if not level:
        return options
    if level not in ("0", "1", "2", "3"):
        raise UserError(f"{CHART_LEVEL_ENV}={level!r}: use an LLVM level 0-3, or unset it for the default 2")
    return options | {"xla_backend_optimization_level": int(level)}


def run_once(fn, *args, **jit_kwargs):
    """fn(*args) jitted with `jit_kwargs` (shardings, ...), compiled with `ONE_SHOT` on the CPU backend and with
    XLA's defaults elsewhere (an accelerator's compile is not the CPU's). Call it where `jax.jit(fn)(*args)` would
    be (inside the same sharding context); it keeps no compiled program."""
    lowered = jax.jit(fn, **jit_kwargs).lower(*args)
    options = ONE_SHOT if jax.default_backend() == "cpu" else {}
    return compile_lowered(lowered, options)(*args)


def compile_ahead(jitted, *args, context=contextlib.nullcontext) -> concurrent.futures.Future:
    """`jitted.lower(*args).compile()` in a thread of its own, inside `context()`: a Future of the program. JAX's jit
    keeps what `lower().compile()` compiled in the cache its calls read, so `jitted(*args)` on arrays of the same
    shapes and shardings then runs it without compiling again (tests/test_train.py counts one compile of the train
    step). `args` may be `jax.ShapeDtypeStruct`s. Why: XLA compiles without Python's lock, so the train step
    compiles while the state initialises; wait on the Future before the first call, or the call compiles the
    program a second time."""
    def lower_and_compile():
        with context():
            return jitted.lower(*args).compile()

    pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="flatlm-compile")
    try:
        return pool.submit(lower_and_compile)
    finally:
        pool.shutdown(wait=False)  # the thread ends with its one task
