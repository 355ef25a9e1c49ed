"""Training: optimizers and schedules, the jitted step, the loop, the adversarial objective (A.4) and gradual
stacking (`train.stacking`)."""

import re

from flatlm import errors
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


_SIZE = re.compile(r"allocate ([0-9.]+)\s*([KMGT]?i?B)")
_UNIT = {"B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40, "KB": 1e3, "MB": 1e6, "GB": 1e9, "TB": 1e12}


def microbatches_that_fit(need: float, free: float, rows: int, current: int) -> int | None:
    """The smallest microbatch count above `current` that divides a device's `rows` and cuts an allocation of
    `need` bytes (made at `current` slices) to `free` bytes, assuming it shrinks as 1 / slices (measured: 31.45 ->
    8.46 GiB from 1 to 4 slices, benchmarks/microbatches.py); None when no divisor does."""
    want = current * need / max(free, 1.0)
    return next((k for k in range(current + 1, rows + 1) if rows % k == 0 and k >= want), None)


def out_of_memory_error(exc: BaseException, config, data_axis: int, data_dir: str) -> UserError | None:
    """The one-line UserError for the train step running out of accelerator memory (`exc` from XLA), naming the fix:
    more microbatches (a count estimated from the failed allocation and the device's free memory when both are
    known), more devices on the data axis or a smaller batch, in a new workdir (a run's config is fixed) that can
    reuse this one's corpus. None when `exc` is something else (another program's OOM is left as it is)."""
    import jax  # reason: only here, after an XLA error

    text = errors.device_out_of_memory(exc)
    if text is None or "train_step" not in text:
        return None
    first = re.sub(r" with allocator \S+|\s*\[[^\]]*\]", "", text.splitlines()[0])
    first = first.removeprefix("RESOURCE_EXHAUSTED: ").rstrip(". ")
    k, rows = config.train.get("microbatches", 1), config.data.batch_size // max(1, data_axis)
    stats = jax.devices()[0].memory_stats() or {}
    size = _SIZE.search(text)
    guess = None
    if size and "bytes_limit" in stats:
        need = float(size.group(1)) * _UNIT.get(size.group(2), 1)
        guess = microbatches_that_fit(need, stats["bytes_limit"] - stats.get("bytes_in_use", 0), rows, k)
    how = (f"--config.train.microbatches={guess} (estimated from the allocation and the device's free memory)"
           if guess else f"--config.train.microbatches=K with K > {k} dividing the {rows} rows a device holds")
    corpus = "" if config.data.data_dir else f"; --config.data.data_dir={data_dir} reuses this run's corpus"
    return UserError(f"the train step ran out of device memory ({first}) at data.batch_size={config.data.batch_size} "
                     f"over a data axis of {data_axis}: rerun in a new --workdir with {how}, more devices on the "
                     f"data axis (--config.mesh.data) or a smaller data.batch_size{corpus}")
