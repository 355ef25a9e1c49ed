"""`flatlm report DIR...`: a markdown report with PNG plots from finished runs or experiments."""

from __future__ import annotations

from flatlm.cli.common import add_output_flags
from flatlm.report import make_report
from flatlm.table import print_json


def add_parser(sub) -> None:
    """Register `report`."""
    p = sub.add_parser("report", help="markdown report with plots from finished runs or experiments")
    p.add_argument("dirs", nargs="+", help="run or experiment workdirs")
    p.add_argument("--out", default=None, help="output folder (default: <first dir>/report)")
    p.add_argument("--control", default=None, metavar="ARM",
                   help="arm (run name without -seed<k>) that the paired table compares every other arm against "
                        "(default: the first arm; `plain` for gradual-stacking experiments); also the per-layer "
                        "probe table's reference")
    add_output_flags(p, quiet=False)
    p.set_defaults(func=run, overrides=False)


def run(args) -> int:
    """Write the report; print it (or its paths with --json)."""
    path = make_report(args.dirs, args.out, args.control)
    if args.json:
        print_json({"report": str(path), "plots": sorted(str(p) for p in path.parent.glob("*.png"))})
    else:
        print(path.read_text())
        print(f"written: {path}")
    return 0
