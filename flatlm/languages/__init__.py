"""Generative languages with exact inference (HMM, PCFG, Dyck, OPT).

Every language has `vocab_size` (words are ids 0..V-1), `max_length`, `sample(n, seed) -> Corpus`,
`log_prob(tokens, lengths) -> [n]` and `conditionals(tokens, lengths) -> [n, T, V]`.
"""

from flatlm.languages.base import Corpus, Language, special_ids

__all__ = ["Corpus", "Language", "special_ids"]
