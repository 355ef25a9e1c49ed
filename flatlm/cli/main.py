"""`flatlm VERB ...`: builds the parser from the verb modules and turns errors into one line and an exit code.

Only the verb being run is imported (`flatlm train` does not load the report's scipy and matplotlib, nor the
theory code): start-up is part of every command's wall time. `flatlm --help` imports them all.
"""

from __future__ import annotations

import errno
import importlib
import logging
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")  # before TensorFlow-datasets' imports below

from flatlm.cli.common import Parser  # noqa: E402
from flatlm.errors import DamagedCheckpoint, DiskFull, NonFiniteLoss, Preempted, RunFailed, UserError  # noqa: E402
from flatlm.experiment_jobs import die_with_parent  # noqa: E402

# A path the user gave that cannot be written (read-only, permission, a file where a folder must be, /proc/...).
USER_PATH_ERRORS = (errno.EACCES, errno.EPERM, errno.EROFS, errno.ENOTDIR, errno.EEXIST, errno.ENOENT, errno.EISDIR)
# flatlm.cli.<verb> modules, each with add_parser(sub), in the order `flatlm --help` lists them
VERBS = ("train", "data", "demo", "evaluate", "flatness", "grow", "experiment", "reproduce", "report", "theory")


def build_parser(verbs: tuple[str, ...] = VERBS) -> Parser:
    """The `flatlm` parser with one sub-command per verb module (all, or only `verbs`); each sets `func(args)`
    and `overrides`."""
    p = Parser(prog="flatlm", description="Same pre-training loss, better downstream: flatlm's command line.")
    sub = p.add_subparsers(dest="verb", required=True, parser_class=Parser)
    for verb in verbs:
        importlib.import_module(f"flatlm.cli.{verb}").add_parser(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    """Run one verb; exit code 0, 1 (training diverged, disk full, damaged checkpoint, a failed run of --jobs), 2
    (user error), 130 (Ctrl-C) or 143 (SIGTERM: the work is saved but unfinished; rerun to resume)."""
    logging.basicConfig(level=logging.WARNING, format="%(message)s", stream=sys.stderr)
    logging.getLogger("absl").setLevel(logging.ERROR)  # orbax/tfds chatter; our own progress goes to stderr
    try:
        die_with_parent()  # a run that `flatlm experiment --jobs N` started stops with its parent
        first = (sys.argv[1:] if argv is None else argv)[:1]
        args, extra = build_parser(tuple(first) if first and first[0] in VERBS else VERBS).parse_known_args(argv)
        if extra and not args.overrides:
            raise UserError(f"unrecognised argument {extra[0]!r} (see `flatlm {args.verb} --help`)")
        args.overrides = extra
        from flatlm.run import enable_compilation_cache, initialize_distributed  # reason: JAX's import, after the
        # cheap argument checks

        enable_compilation_cache()
        initialize_distributed()  # a process of a multi-host launch (JAX_COORDINATOR_ADDRESS, ...): join it first
        return args.func(args)
    except UserError as e:
        print(f"flatlm: error: {e}", file=sys.stderr)
        return 2
    except NonFiniteLoss as e:
        print(f"flatlm: training stopped: {e}", file=sys.stderr)
        return 1
    except (DiskFull, DamagedCheckpoint, RunFailed) as e:
        print(f"flatlm: {e}", file=sys.stderr)
        return 1
    except Preempted as e:
        print(f"flatlm: {e}", file=sys.stderr)
        return 143
    except OSError as e:
        if e.errno not in USER_PATH_ERRORS:
            raise
        print(f"flatlm: error: cannot write {e.filename or 'a file'}: {e.strerror}; choose a writable "
              "--workdir / --data-dir / --out", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("flatlm: interrupted", file=sys.stderr)
        return 130
