"""flatlm: same pre-training loss, better downstream -- implicit bias and flatness for language models in JAX."""

from flatlm import allocator as _allocator
from flatlm import cpu_codegen as _cpu_codegen

__version__ = "0.1.0"

_allocator.configure()  # before XLA:CPU's first buffer: see flatlm/allocator.py (FLATLM_MALLOC=system opts out)
_cpu_codegen.configure()  # before XLA reads XLA_FLAGS: one LLVM module per program on <= 2 CPUs (flatlm/cpu_codegen.py)
