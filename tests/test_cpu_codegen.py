"""flatlm.cpu_codegen: one LLVM module per program on <= 2 CPUs, the caller's flag kept, and the same bits."""

from __future__ import annotations

import os
import subprocess
import sys

import flatness_tiny
import jax
import numpy as np
import pytest

from flatlm import cpu_codegen
from flatlm.models.losses import mlm_loss


@pytest.mark.parametrize("cpus, flags, want", [
    (2, "", "--xla_cpu_parallel_codegen_split_count=1"),
    (1, "--xla_force_host_platform_device_count=8",
     "--xla_force_host_platform_device_count=8 --xla_cpu_parallel_codegen_split_count=1"),
    (2, "--xla_cpu_parallel_codegen_split_count=32", "--xla_cpu_parallel_codegen_split_count=32"),  # caller's wins
    (3, "--xla_backend_optimization_level=1", "--xla_backend_optimization_level=1"),  # more CPUs: not measured
])
def test_the_flag_is_added_only_on_two_cpus_and_never_over_the_callers(cpus, flags, want):
    environ = {"XLA_FLAGS": flags} if flags else {}
    added = cpu_codegen.configure(environ, cpus=cpus)
    assert environ.get("XLA_FLAGS", "") == want
    assert added == (None if want == flags else "--xla_cpu_parallel_codegen_split_count=1")


def test_importing_flatlm_sets_it_before_xla_starts():
    """A fresh process pinned to one CPU: `import flatlm` puts the flag in XLA_FLAGS; a caller's value stays."""
    pin = ("os.sched_setaffinity(0, {min(os.sched_getaffinity(0))}); "  # one CPU of those this process may use
           if hasattr(os, "sched_setaffinity") else "")  # else: the machine's own count
    code = f"import os; {pin}import flatlm; print(os.environ.get('XLA_FLAGS', ''))"
    if not pin and cpu_codegen.usable_cpus() > cpu_codegen.MAX_CPUS:
        pytest.skip("no CPU affinity to pin the process to one CPU, and this machine has more than two")
    for flags, want in (("", "--xla_cpu_parallel_codegen_split_count=1"),
                        ("--xla_cpu_parallel_codegen_split_count=4", "--xla_cpu_parallel_codegen_split_count=4")):
        env = {**os.environ, "XLA_FLAGS": flags}
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
        assert out.stdout.strip() == want


@pytest.mark.parametrize("level", [1, 2, 3])  # ONE_SHOT, CHART, XLA's default
def test_a_gradient_has_the_same_bits_with_one_module_or_thirty_two(level):
    """The split changes how XLA:CPU compiles, not what, at the LLVM levels flatlm compiles with: a tiny BERT's
    MLM gradient, compiled at -O`level` with the module in 1 part and in XLA's default 32, is bitwise the same.
    (At -O0, `make test`'s level, 7 of the 8 floats of a leaf moved by up to 1.3e-8: rounding.)"""
    model, params = flatness_tiny.tiny_bert(dtype="float32")
    batch = flatness_tiny.mlm_batch(0)
    lowered = jax.jit(jax.grad(lambda p: mlm_loss(p, batch, model.apply))).lower(params)
    # lowered.compile, not compile_options.compile_lowered: an option this XLA did not know would be dropped there
    # and the two programs would be one
    grads = [lowered.compile(compiler_options={"xla_cpu_parallel_codegen_split_count": split,
                                               "xla_backend_optimization_level": level})(params) for split in (1, 32)]
    for a, b in zip(jax.tree.leaves(grads[0]), jax.tree.leaves(grads[1]), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert any(np.abs(np.asarray(g)).max() > 0 for g in jax.tree.leaves(grads[0]))
