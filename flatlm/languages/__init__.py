"""Generative languages with exact inference (HMM, PCFG, Dyck, OPT).

Every language has `vocab_size` (words are ids 0..V-1), `max_length`, `sample(n, seed) -> Corpus`,
`log_prob(tokens, lengths) -> [n]` and `conditionals(tokens, lengths) -> [n, T, V]`.
"""

import os

from flatlm.config import check_choice, check_positive
from flatlm.errors import UserError
from flatlm.languages import hmm, opt, pcfg
from flatlm.languages.base import Corpus, Language, special_ids

__all__ = ["Corpus", "Language", "special_ids", "make_language", "validate_config", "TRAINABLE"]

TRAINABLE = ("hmm", "pcfg", "opt")  # languages a run can pre-train on (Dyck is Section 6's own setting)


def validate_config(spec) -> None:
    """Check a config's `language` section; one line naming `language.<field>` on failure."""
    check_choice(spec.name, TRAINABLE, "language.name")
    if spec.name == "hmm":
        check_positive(spec, "language", "num_states", "vocab_size", "length", "num_blocks")
        if spec.num_blocks > min(spec.num_states, spec.vocab_size):
            raise UserError(f"config.language.num_blocks={spec.num_blocks} exceeds min(num_states, vocab_size) = "
                            f"{min(spec.num_states, spec.vocab_size)}; lower it")
    if spec.name == "pcfg" and spec.max_length < 0:
        raise UserError(f"config.language.max_length must be >= 0 (0: the grammar's longest), got {spec.max_length}")


def make_language(spec):
    """Build the language a config's `language` section names (deterministic in its seed)."""
    name = spec["name"]
    if name == "hmm":
        return hmm.random_hmm(
            spec["seed"], num_states=spec["num_states"], vocab_size=spec["vocab_size"],
            length=spec["length"], num_blocks=spec["num_blocks"],
        )
    if name == "pcfg":
        max_length = int(spec.get("max_length") or 0) or None
        if spec.get("rules_file"):
            if not os.path.isfile(spec["rules_file"]):
                raise UserError(f"language.rules_file {spec['rules_file']!r} not found; give a path to a rules file")
            return pcfg.PCFG.from_rules_file(spec["rules_file"], max_length=max_length)
        try:
            return pcfg.random_grammar(spec["seed"], max_length=max_length, **dict(spec.get("grammar") or {}))
        except (TypeError, ValueError) as e:
            raise UserError(f"language.grammar / language.max_length: {e}") from None
    if name == "opt":
        return opt.from_spec(spec)
    raise UserError(f"language {name!r} cannot be trained on; use hmm, pcfg or opt")
