"""Corpora (tfds array_record builders) and grain input pipelines: masking, batching, host sharding."""

from flatlm.config import check_choice, check_positive
from flatlm.errors import UserError

MASKINGS = ("single", "bert")  # one masked word per sentence (paper) | BERT's 15% with 80/10/10
SOURCES = ("tfds", "stream")  # materialised splits | sampled on the fly


def validate_config(data) -> None:
    """Check a config's `data` section; one line naming `data.<field>` on failure."""
    check_choice(data.masking, MASKINGS, "data.masking")
    check_choice(data.source, SOURCES, "data.source")
    check_positive(data, "data", "batch_size", "eval_size", "train_size", "stream_block")
    if getattr(data, "fixed_masks", False) and data.source != "tfds":
        raise UserError("config.data.fixed_masks needs data.source=tfds (the stream source never repeats a sentence)")
    if not 0 < data.mask_prob <= 1:
        raise UserError(f"config.data.mask_prob must be in (0, 1], got {data.mask_prob}")
