"""The `flatlm` command line: one module per verb, each a thin layer over importable functions (so a Colab can
call the same code). This package is the only place that parses arguments and prints tables.

User mistakes print one line `flatlm: error: ...` on stderr and exit with code 2. Verbs that print a table
accept `--json` and then print the same results as one JSON object on stdout (progress goes to stderr).
"""

from flatlm.cli.main import main

__all__ = ["main"]
