"""Training: optimizers and schedules, the jitted step, the loop, the adversarial objective (A.4) and gradual
stacking (`train.stacking`)."""

from flatlm.config import check_choice, check_positive
from flatlm.errors import UserError
from flatlm.models.blocks import ALL, ENCODER, parse_blocks
from flatlm.train import adversarial, flat_objectives, stacking

OPTIMIZERS = ("adamw", "sgd")
SCHEDULES = ("linear", "constant", "cosine")
TASK_LANGUAGES = ("hmm", "pcfg")  # languages with downstream tasks for the adversarial objective


def validate_config(config) -> None:
    """Check a config's `train` section (with `train.adversarial`, which also needs a language with downstream
    tasks); one line naming the field on failure. Opening a run checks the other sections (`flatlm.run`)."""
    train = config.train
    check_choice(train.optimizer, OPTIMIZERS, "train.optimizer")
    check_choice(train.schedule, SCHEDULES, "train.schedule")
    check_positive(train, "train", "steps", "log_every", "eval_every", "lr")
    if train.get("rank_every", 0) < 0:
        raise UserError(f"config.train.rank_every must be >= 0 (0: off), got {train.rank_every}")
    if not 0 <= train.warmup_frac < 1:
        raise UserError(f"config.train.warmup_frac must be in [0, 1), got {train.warmup_frac}")
    adv = adversarial.AdversarialConfig(**train.adversarial)
    if adv.lam < 0 or adv.active:
        adversarial.validate(adv)
    if adv.active and config.language.name not in TASK_LANGUAGES:
        raise UserError("the adversarial objective needs a language with downstream tasks (hmm or pcfg)")
    flat = flat_objectives.FlatConfig(**train.get("flat", {}))
    flat_objectives.validate(flat, config.data.batch_size)
    if adv.active and flat.method != "none":
        raise UserError(f"config.train.flat.method={flat.method!r} and the adversarial objective cannot be combined; "
                        "set one of them off")
    if adv.active and adv.start_step >= train.steps:
        raise UserError(f"config.train.adversarial.start_step={adv.start_step} must be in [0, train.steps)")
    k = train.get("microbatches", 1)
    if k < 1 or config.data.batch_size % k:
        raise UserError(f"config.train.microbatches={k} must be >= 1 and divide data.batch_size="
                        f"{config.data.batch_size} (1: no gradient accumulation)")
    if k > 1 and (adv.active or flat.method in ("sam", "trace_penalty")):
        which = "train.adversarial (lam > 0 or monitor)" if adv.active else f"train.flat.method={flat.method}"
        raise UserError(f"config.train.microbatches={k} works with the MLM loss and label noise (means over the "
                        f"masked tokens), not with {which}, whose loss is not a sum over slices of the batch; "
                        "set microbatches=1")
    stacking.validate(config)
    if train.get("stacking", {}).get("stages") and parse_blocks(flat.blocks) not in ((ALL,), (ENCODER,)):
        raise UserError(f"config.train.flat.blocks={flat.blocks!r} names blocks, which train.stacking adds stage by "
                        "stage; with stacking use 'all' or 'encoder'")
