"""flatlm: same pre-training loss, better downstream -- implicit bias and flatness for language models in JAX."""

from flatlm import allocator as _allocator

__version__ = "0.1.0"

_allocator.configure()  # before XLA:CPU's first buffer: see flatlm/allocator.py (FLATLM_MALLOC=system opts out)
