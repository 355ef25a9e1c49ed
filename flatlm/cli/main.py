"""`flatlm VERB ...`: builds the parser from the verb modules and turns errors into one line and an exit code."""

from __future__ import annotations

import errno
import logging
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")  # before TensorFlow-datasets' imports below

from flatlm.checkpoint import DamagedCheckpoint  # noqa: E402
from flatlm.cli import data, demo, evaluate, experiment, flatness, grow, report, reproduce, theory, train  # noqa: E402
from flatlm.cli.common import Parser  # noqa: E402
from flatlm.errors import DiskFull, UserError  # noqa: E402
from flatlm.run import initialize_distributed  # noqa: E402
from flatlm.train.loop import NonFiniteLoss, Preempted  # noqa: E402

# A path the user gave that cannot be written (read-only, permission, a file where a folder must be, /proc/...).
USER_PATH_ERRORS = (errno.EACCES, errno.EPERM, errno.EROFS, errno.ENOTDIR, errno.EEXIST, errno.ENOENT, errno.EISDIR)
VERBS = (train, data, demo, evaluate, flatness, grow, experiment, reproduce, report, theory)  # each has add_parser(sub)


def build_parser() -> Parser:
    """The `flatlm` parser with one sub-command per verb module; each sets `func(args)` and `overrides`."""
    p = Parser(prog="flatlm", description="Same pre-training loss, better downstream: flatlm's command line.")
    sub = p.add_subparsers(dest="verb", required=True, parser_class=Parser)
    for verb in VERBS:
        verb.add_parser(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    """Run one verb; exit code 0, 1 (training diverged, disk full, damaged checkpoint), 2 (user error), 130
    (Ctrl-C) or 143 (SIGTERM: the work is saved but unfinished; rerun to resume)."""
    logging.basicConfig(level=logging.WARNING, format="%(message)s", stream=sys.stderr)
    logging.getLogger("absl").setLevel(logging.ERROR)  # orbax/tfds chatter; our own progress goes to stderr
    try:
        args, extra = build_parser().parse_known_args(argv)
        if extra and not args.overrides:
            raise UserError(f"unrecognised argument {extra[0]!r} (see `flatlm {args.verb} --help`)")
        args.overrides = extra
        initialize_distributed()  # a process of a multi-host launch (JAX_COORDINATOR_ADDRESS, ...): join it first
        return args.func(args)
    except UserError as e:
        print(f"flatlm: error: {e}", file=sys.stderr)
        return 2
    except NonFiniteLoss as e:
        print(f"flatlm: training stopped: {e}", file=sys.stderr)
        return 1
    except (DiskFull, DamagedCheckpoint) as e:
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
