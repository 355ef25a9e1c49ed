"""`flatlm demo`: the paper's story on a small PCFG, end to end on a laptop CPU (see `flatlm.demo`)."""

from __future__ import annotations

from flatlm import demo
from flatlm.cli.common import add_output_flags, non_negative_int
from flatlm.report import ESTIMATOR_LABELS
from flatlm.table import print_json, print_table


def add_parser(sub) -> None:
    """Register `demo`."""
    p = sub.add_parser("demo", help="the paper's story on a small language, on CPU, in minutes")
    p.add_argument("--workdir", default="demo_workdir")
    p.add_argument("--steps", type=non_negative_int, default=0, help="training steps (0: the demo's default)")
    add_output_flags(p)
    p.set_defaults(func=run, overrides=False)


def run(args) -> int:
    """Train, evaluate and measure the demo; print its table."""
    result = demo.run(args.workdir, steps=args.steps, progress=not args.quiet)
    if args.json:
        print_json(result)
    else:
        print_report(result)
    return 0


def print_report(result: dict) -> None:
    """The demo's table: exact loss = entropy + KL, probe accuracy and the Fisher trace (the
    paper's B.1 estimator, labelled as such) per checkpoint, and the lookup table."""
    print(f"\nPCFG language (random grammar of the paper's shape, seed {result['language']['seed']}); loss in nats per "
          f"masked position; probe = linear probe accuracy on task {result['task']} (the most likely root child of "
          "the sentence, released definition), mean ± std over seeds:")
    rows = []
    for r in result["rows"]:
        rows.append({**r, "probe_s": f"{100 * r['probe']:.1f} ± {100 * r['probe_std']:.1f}" if "probe" in r else None,
                     "trace_s": f"{r['trace']:.4g} ± {r['trace_stderr']:.2g}" if "trace" in r else None})
    lk = result["lookup_table"]
    if lk:
        rows.append({"step": "lookup", "loss": rows[-1].get("entropy") if rows else None, "entropy": None,
                     "kl": 0.0, "probe_s": f"{100 * lk['accuracy']:.1f} ± {100 * lk['accuracy_std']:.1f}"})
    print_table(rows, [("step", "step", ""), ("loss", "exact loss", ".4f"), ("entropy", "entropy", ".4f"),
                       ("kl", "KL", ".4f"), ("probe_s", "probe acc %", "s"),
                       ("trace_s", ESTIMATOR_LABELS["fisher"], "s")])
    print("\nlookup = a probe on the exact conditionals (a model with the optimal loss, KL = 0)")
    print(f"workdir: {result['workdir']} (config.json, checkpoints/, metrics.jsonl, tensorboard/, results.json)")
