"""What every verb shares: the argument parser that fails in one line, config loading with `--config.x=y`
overrides, and the one parser of checkpoint-step lists."""

from __future__ import annotations

import argparse

from flatlm import config as config_lib
from flatlm.errors import UserError


class Parser(argparse.ArgumentParser):
    """argparse that raises a one-line UserError (exit 2, argparse's own convention) instead of a usage dump."""

    def error(self, message):
        """Raise instead of printing usage and exiting."""
        raise UserError(f"{message} (see `{self.prog} --help`)")


def positive_int(text: str) -> int:
    """argparse type: an integer >= 1."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return value


def non_negative_int(text: str) -> int:
    """argparse type: an integer >= 0."""
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
    return value


def seed_list(text: str) -> tuple[int, ...]:
    """argparse type of --seeds: comma-separated integers, e.g. 3,4,5 (`flatlm.experiment.with_seeds` checks them)."""
    try:
        return tuple(int(k) for k in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: write comma-separated integers, e.g. --seeds 3,4,5") from None


OVERRIDES_HELP = ("any config field can be set on the command line after the other flags, absl style: "
                  "--config.section.field=value (e.g. --config.train.steps=200 --config.model.d_model=128); "
                  "values are type-checked against the config")


def add_config_and_workdir(p: argparse.ArgumentParser, config_help: str) -> None:
    """The required `--config FILE.py[:PRESET]` and `--workdir DIR` of the verbs that start runs, and the help's
    note on presets and `--config.x=y` overrides."""
    p.add_argument("--config", required=True, help=f"{config_help}: a config file and an optional preset after "
                   "the colon (the file's docstring lists them, e.g. tiny, cpu, demo, paper)")
    p.add_argument("--workdir", required=True, help="the run's folder (local or gs://bucket/...); an existing run "
                   "there is resumed")
    p.epilog = OVERRIDES_HELP


def add_output_flags(p: argparse.ArgumentParser, quiet: bool = True) -> None:
    """`--json` (the results as one JSON object on stdout) and, with `quiet`, `--quiet` (no progress bars)."""
    p.add_argument("--json", action="store_true", help="print the results as one JSON object on stdout")
    if quiet:
        p.add_argument("--quiet", action="store_true", help="no progress bars")


def apply_overrides(config, overrides: list[str], hint: str = "--config.train.steps=200"):
    """`config` with absl-style `--config.a.b=value` overrides applied (type-checked); anything else is an error."""
    bad = [a for a in overrides if not a.startswith("--config.")]
    if bad:
        raise UserError(f"unrecognised argument {bad[0]!r}; config overrides look like {hint}")
    return config_lib.apply_overrides(config, overrides)


def load_config(spec: str, overrides: list[str]):
    """The run config `FILE.py[:ARG]` with its `--config.a.b=value` overrides."""
    return apply_overrides(config_lib.load_config(spec), overrides)


def parse_steps(spec: str, available: list[int]) -> list[int]:
    """`all` | `last` (or `latest`) | `none` | comma-separated steps -> checkpoint steps, each of which must exist
    (`none`: no checkpoint, only what is measured once per run, e.g. the lookup tables)."""
    if spec == "none":
        return []
    if not available:
        raise UserError("the run has no checkpoints yet; train it first (flatlm train ...)")
    if spec in ("all", ""):
        return list(available)
    if spec in ("last", "latest"):
        return list(available[-1:])
    try:
        wanted = [int(s) for s in spec.split(",") if s]
    except ValueError:
        raise UserError(f"--steps {spec!r} is not all, last, none or a comma-separated list of steps") from None
    missing = [s for s in wanted if s not in available]
    if missing:
        raise UserError(f"no checkpoint at step(s) {missing}; available: {available}")
    return wanted
