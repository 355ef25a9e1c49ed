"""`flatlm grow --workdir DIR --to NAME [--out DIR | --out FILE.npz]`: embed a run's small BERT into a larger one
computing the same function (paper B.4), optionally checking logits and loss, and write the grown model: by default
a new run workdir (config.json + orbax checkpoint) that `flatlm evaluate / flatness` read, or an .npz file."""

from __future__ import annotations

import dataclasses
import sys
from typing import Any

import jax

from flatlm import paths
from flatlm.cli.common import add_output_flags, non_negative_int, parse_steps, positive_int
from flatlm.errors import UserError
from flatlm.flatness import grow
from flatlm.models.bert import SHAPES, BertConfig
from flatlm.run import load_run
from flatlm.table import print_json, print_table


def add_parser(sub) -> None:
    """Register `grow`."""
    g = sub.add_parser("grow", help="embed a run's small BERT into a larger one, same function",
                       description="Embed a run's small BERT into a larger one computing the same function and "
                       "write it as a new run (flatlm evaluate --workdir OUT reads it).")
    g.add_argument("--workdir", required=True, help="the small run")
    g.add_argument("--step", default="last", help="checkpoint step to grow (default: the last)")
    g.add_argument("--to", help=f"target shape, Table 3 or 4: {', '.join(SHAPES)}")
    g.add_argument("--d-model", type=positive_int)
    g.add_argument("--num-layers", type=positive_int)
    g.add_argument("--init", choices=("zeros", "random"), default="zeros", help="new blocks' input-side weights")
    g.add_argument("--out", help="a new folder: a run workdir with an orbax checkpoint (default: "
                   "<workdir>/grown/L<layers>-H<d_model>-step<step>); a name ending in .npz: an .npz file instead")
    g.add_argument("--check", action="store_true", help="compare small and grown logits/loss on eval batches")
    g.add_argument("--num-batches", type=positive_int, default=2)
    g.add_argument("--batch-size", type=positive_int, default=64)
    g.add_argument("--seed", type=non_negative_int, default=0)
    add_output_flags(g, quiet=False)
    g.set_defaults(func=run, overrides=False)


def target_shape(args) -> tuple[int, int]:
    """(num_layers, d_model) from `--to NAME` (Table 3 or Table 4) or `--num-layers` and `--d-model`."""
    if args.to:
        if args.to not in SHAPES:
            raise UserError(f"unknown --to {args.to!r}; choose one of {', '.join(SHAPES)}")
        return SHAPES[args.to]
    if args.d_model is None or args.num_layers is None:
        raise UserError("give --to NAME or both --d-model and --num-layers")
    return args.num_layers, args.d_model


def run(args) -> int:
    """Grow the chosen checkpoint; print the shapes (and the check's logit difference and losses)."""
    run_ = load_run(args.workdir)
    small_cfg = getattr(run_.model, "cfg", None)
    if not isinstance(small_cfg, BertConfig):
        raise UserError("grow supports BERT runs only")
    step = parse_steps(args.step, list(run_.steps))[-1]
    num_layers, d_model = target_shape(args)
    try:
        big_cfg = grow.grown_config(small_cfg, d_model=d_model, num_layers=num_layers)
        key = jax.random.key(args.seed) if args.init == "random" else None
        params = grow.embed(run_.load_params(step), small_cfg, big_cfg, key=key)
    except ValueError as e:
        shape = f"{small_cfg.num_layers}x{small_cfg.d_model} to {num_layers}x{d_model}"
        raise UserError(f"cannot grow {shape}: {e}") from e
    result: dict[str, Any] = {"workdir": args.workdir, "step": step, "small": dataclasses.asdict(small_cfg),
                              "big": dataclasses.asdict(big_cfg)}
    if args.check:
        batches = run_.mlm_batches(args.num_batches, args.batch_size, seed=args.seed)
        result.update(grow.check_embedding(run_.model.apply, run_.load_params(step), type(run_.model)(big_cfg).apply,
                                           params, batches))
    out = args.out or str(paths.path(args.workdir, "grown", f"L{num_layers}-H{d_model}-step{step}"))
    if out.endswith(".npz"):
        grow.save_npz(out, params, big_cfg)
        print(f"grow: wrote {out} (.npz: parameter paths and __config__)", file=sys.stderr)
    else:
        grow.save_run(out, run_, params, big_cfg, step)
        print(f"grow: wrote the grown run to {out} (checkpoint {step}); evaluate it with "
              f"flatlm evaluate --workdir {out}", file=sys.stderr)
    result["out"] = out
    if args.json:
        print_json(result)
    else:
        print_table([{"from": f"L{small_cfg.num_layers}-H{small_cfg.d_model}", "to": f"L{num_layers}-H{d_model}",
                      "max_abs_logit_diff": result.get("max_abs_logit_diff"), "loss_small": result.get("loss_small"),
                      "loss_big": result.get("loss_big"), "out": out}],
                    ["from", "to", "max_abs_logit_diff", "loss_small", "loss_big", "out"])
    return 0
