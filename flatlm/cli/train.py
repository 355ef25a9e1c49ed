"""`flatlm train --config FILE[:PRESET] --workdir DIR [--config.x=y ...]`: pre-train, resuming from the workdir."""

from __future__ import annotations

from flatlm.cli.common import add_config_and_workdir, add_output_flags, load_config
from flatlm.table import print_json
from flatlm.train.loop import train_and_evaluate


def add_parser(sub) -> None:
    """Register `train`."""
    p = sub.add_parser("train", help="pre-train a model from a config (resumes from the workdir)")
    add_config_and_workdir(p, "configs/FILE.py[:PRESET]")
    add_output_flags(p)
    p.set_defaults(func=run, overrides=True)


def unit(metric: str) -> str:
    """The unit of an exact-loss metric as printed: nats per masked position; log KL (natural log) has none."""
    return "" if metric.endswith("log_kl") else " nats"


def run(args) -> int:
    """Train; print the final exact-loss evaluation."""
    config = load_config(args.config, args.overrides)
    result = train_and_evaluate(config, args.workdir, progress=not args.quiet)
    if args.json:
        print_json({"workdir": args.workdir, **result})
    else:
        print(f"done: {args.workdir}  " + "  ".join(f"{k}={v:.4g}{unit(k)}" for k, v in result.items()
                                                    if isinstance(v, float)))
    return 0
