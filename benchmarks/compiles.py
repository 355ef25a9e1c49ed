"""Where a `flatlm` command's first call spends its compile time: every XLA compile of one in-process run, grouped
by jitted function (count, seconds), with the command's wall time. A function compiled more often than its shapes
explain is the sign of a layout or cache-key change between calls (e.g. a fresh array off the mesh that restored
parameters live on; `flatlm.sharding.replicate_like`), and many small compiles (add, multiply, ...) are eager tree
maps outside a jit. The persistent compilation cache is off, so every compile counts.

    python benchmarks/compiles.py [--explain] -- flatness --workdir RUN --preconditioned ...

Without a command it profiles the start-up goal's command (issue 17): `flatlm train --config
configs/pcfg_mlm.py:tiny` for one step in a temporary workdir, which is what `make bench` runs. --explain also
prints JAX's reason for each tracing-cache miss."""

from __future__ import annotations

import argparse
import collections
import logging
import os
import sys
import tempfile
import time
from pathlib import Path

import jax

# The start-up goal's command (benchmarks/startup_pipeline.py times it); its corpus is built by the run itself.
TINY_TRAIN = ["train", "--config", str(Path(__file__).resolve().parents[1] / "configs/pcfg_mlm.py:tiny"),
              "--quiet", "--config.train.steps=1"]


class _Compiles(logging.Handler):
    """Collects JAX's "Finished XLA compilation of jit(NAME) in T sec" records; prints cache-miss explanations."""

    def __init__(self, explain: bool):
        super().__init__()
        self.count, self.seconds, self.explain = collections.Counter(), collections.Counter(), explain

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if message.startswith("Finished XLA compilation of"):
            words = message.split()
            self.count[words[4]] += 1
            self.seconds[words[4]] += float(words[6])
        elif self.explain and "TRACING CACHE MISS" in message:
            print(message, file=sys.stderr)


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--explain", action="store_true", help="print JAX's reason for every tracing-cache miss")
    parser.add_argument("--top", type=int, default=20, help="functions listed, by compile seconds")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- then the flatlm command line")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        with tempfile.TemporaryDirectory() as workdir:
            return profile(TINY_TRAIN + ["--workdir", workdir], args)
    return profile(command, args)


def profile(command: list[str], args: argparse.Namespace) -> None:
    """Run `flatlm COMMAND` in this process and print its compiles, grouped by jitted function."""
    os.environ["FLATLM_COMPILATION_CACHE"] = "off"
    jax.config.update("jax_log_compiles", True)
    jax.config.update("jax_explain_cache_misses", args.explain)
    handler = _Compiles(args.explain)
    logger = logging.getLogger("jax")
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    logger.propagate = False  # jax_log_compiles logs every compile at WARNING: keep them off the terminal

    from flatlm.cli.main import main as flatlm_main

    start = time.perf_counter()
    try:
        code = flatlm_main(command)
    except SystemExit as exit_:
        code = exit_.code
    wall = time.perf_counter() - start
    total = sum(handler.seconds.values())
    print(f"\n{' '.join(command)}\nwall {wall:.2f} s, {sum(handler.count.values())} compiles, {total:.2f} s compiling")
    print(f"{'count':>5} {'seconds':>8}  function")
    for name, seconds in handler.seconds.most_common(args.top):
        print(f"{handler.count[name]:5d} {seconds:8.2f}  {name}")
    if code:
        print(f"(the command failed with exit code {code}: a profile of a failed run)")
        sys.exit(code)


if __name__ == "__main__":
    main(sys.argv[1:])
