"""Generative languages with exact inference (HMM, PCFG, Dyck, OPT, SCB).

Every language has `vocab_size` (words are ids 0..V-1), `max_length`, `sample(n, seed) -> Corpus`,
`log_prob(tokens, lengths) -> [n]` and `conditionals(tokens, lengths) -> [n, T, V]`.
"""

import os

from flatlm.config import check_choice, check_positive
from flatlm.errors import UserError
from flatlm.languages import hmm, opt, pcfg, scb
from flatlm.languages.base import Corpus, Language, special_ids

__all__ = ["Corpus", "Language", "special_ids", "make_language", "validate_config", "TRAINABLE"]

TRAINABLE = ("hmm", "pcfg", "opt", "scb")  # languages a run can pre-train on (Dyck is Section 6's own setting)


def validate_config(spec) -> None:
    """Check a config's `language` section; one line naming `language.<field>` on failure."""
    check_choice(spec.name, TRAINABLE, "language.name")
    if spec.name == "hmm":
        check_positive(spec, "language", "num_states", "vocab_size", "length", "num_blocks")
        if spec.num_blocks > min(spec.num_states, spec.vocab_size):
            raise UserError(f"config.language.num_blocks={spec.num_blocks} exceeds min(num_states, vocab_size) = "
                            f"{min(spec.num_states, spec.vocab_size)}; lower it")
    if spec.name == "scb":
        _scb_fields(spec)
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
    if name == "scb":
        return scb.random_scb(spec["seed"], **_scb_fields(spec))
    raise UserError(f"language {name!r} cannot be trained on; use hmm, pcfg, opt or scb")


SCB_FIELDS = ("vocab_size", "context_length", "sparsity", "concentration")  # N, T, |supp Q_k|, Dirichlet of P


def _scb_fields(spec) -> dict:
    """random_scb's keyword arguments from an SCB language section (fields in configs/scb_mlm.py), checked."""
    missing = [f for f in SCB_FIELDS if f not in spec]
    if missing:
        raise UserError(f"config.language.name=scb needs config.language.{missing[0]}; start from configs/scb_mlm.py")
    N, T, k, alpha = (spec[f] for f in SCB_FIELDS)
    if N < 1 or T < 1 or alpha <= 0:
        raise UserError(f"config.language.vocab_size, context_length and concentration must be > 0 "
                        f"(got {N}, {T}, {alpha})")
    if not 1 <= k <= T:
        raise UserError(f"config.language.sparsity={k} must lie in 1..config.language.context_length={T}; lower it")
    return dict(num_words=int(N), context_length=int(T), sparsity=int(k), concentration=float(alpha))
