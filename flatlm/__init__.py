"""flatlm: same pre-training loss, better downstream -- implicit bias and flatness for language models in JAX."""

__version__ = "0.1.0"
