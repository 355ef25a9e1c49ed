"""Section 6's synthetic bracket language (Liu et al. 2023, Sec. 6, Thm 6.1): balanced-count strings, one mask.

Definitions (where the paper leaves a detail open, the choice is written here and in the final report):
- Words: 0 = "(" (open), 1 = ")" (close); the sign of a bracket is s = +1 for open, -1 for close.
- Pre-training: x uniform over the C(T, T/2) strings of even length T with T/2 brackets of each kind (equal counts;
  nesting is not required), t uniform over the T positions, sigma uniform over {+1, -1}. The target is the masked
  bracket's sign y = s_t, which equals #close - #open over the visible tokens, i.e. g* of the visible string.
- Encoding in R^{2T} (0-based positions): a visible bracket at position j is s_j e_j; the mask at position t is
  sigma e_{t+T}. The random sign makes the mask direction carry no information about y.
- Downstream: x uniform over {(, )}^T (i.i.d. fair brackets), nothing masked, target g*(x) = #close - #open.

A batch is a plain dict of numpy arrays: `x` float[B, T, 2T] encodings, `y` float[B] targets, `w` float[B] weights
summing to 1 (uniform for enumerations and samples alike, so `sum(w * v)` is the population mean or the MC mean),
`tokens` int8[B, T], `mask_pos` int32[B] (-1 downstream), `mask_sign` float[B] (0 downstream).
Exact population expectations enumerate every outcome (T <= MAX_ENUM_T); beyond that, sample.
"""

from __future__ import annotations

import dataclasses
import itertools
import math

import numpy as np

from flatlm.errors import UserError
from flatlm.languages.base import Corpus

OPEN, CLOSE = 0, 1
MAX_ENUM_T = 14  # pre-training rows T * C(T, T/2) * 2 = 96096 and downstream rows 2^T = 16384 at T = 14

Batch = dict[str, np.ndarray]


def check_length(T: int, enumerate_: bool = False) -> None:
    """Raise UserError unless T is a positive even length (and small enough to enumerate, if asked)."""
    if T < 2 or T % 2:
        raise UserError(f"Dyck length T={T} must be even and >= 2; pass an even --T such as 6")
    if enumerate_ and T > MAX_ENUM_T:
        raise UserError(
            f"T={T} is too large to enumerate (limit {MAX_ENUM_T}); pass --samples N to use Monte-Carlo estimates"
        )


def signs(tokens_BT: np.ndarray) -> np.ndarray:
    """Bracket signs float64[B, T]: +1 for open, -1 for close."""
    return np.where(np.asarray(tokens_BT) == OPEN, 1.0, -1.0)


def g_star(tokens_BT: np.ndarray) -> np.ndarray:
    """Downstream target float64[B]: #close - #open (= -sum of signs), the paper's g* (Section 6, eq. (2))."""
    return -signs(tokens_BT).sum(axis=-1)


def encode(tokens_BT: np.ndarray, mask_pos_B: np.ndarray | None = None,
           mask_sign_B: np.ndarray | None = None) -> np.ndarray:
    """Encodings float64[B, T, D = 2T]: s_j e_j for visible brackets, sigma e_{t+T} at the masked position t,
    sigma = mask_sign_B (uniform on +-1 in pre-training; Section 6, "Encoding of the Inputs")."""
    tokens_BT = np.asarray(tokens_BT)
    B, T = tokens_BT.shape
    x_BTD = np.zeros((B, T, 2 * T))
    pos_T = np.arange(T)
    x_BTD[:, pos_T, pos_T] = signs(tokens_BT)
    if mask_pos_B is not None:
        rows_B = np.arange(B)
        x_BTD[rows_B, mask_pos_B, mask_pos_B] = 0.0
        x_BTD[rows_B, mask_pos_B, mask_pos_B + T] = mask_sign_B
    return x_BTD


def balanced_strings(T: int) -> np.ndarray:
    """All C(T, T/2) strings with T/2 opens, int8[C, T], in lexicographic order of the open positions."""
    check_length(T)
    combos = list(itertools.combinations(range(T), T // 2))
    tokens_CT = np.full((len(combos), T), CLOSE, dtype=np.int8)
    for i, opens in enumerate(combos):
        tokens_CT[i, list(opens)] = OPEN
    return tokens_CT


def all_strings(T: int) -> np.ndarray:
    """All 2^T bracket strings, int8[2^T, T]."""
    codes_N = np.arange(2**T)
    return ((codes_N[:, None] >> np.arange(T)[None, :]) & 1).astype(np.int8)


def _pretrain_batch(tokens_BT, mask_pos_B, mask_sign_B) -> Batch:
    B = tokens_BT.shape[0]
    y_B = signs(tokens_BT)[np.arange(B), mask_pos_B]
    return {
        "x": encode(tokens_BT, mask_pos_B, mask_sign_B),
        "y": y_B,
        "w": np.full(B, 1.0 / B),
        "tokens": tokens_BT.astype(np.int8),
        "mask_pos": mask_pos_B.astype(np.int32),
        "mask_sign": mask_sign_B.astype(np.float64),
    }


def _downstream_batch(tokens_BT) -> Batch:
    B = tokens_BT.shape[0]
    return {
        "x": encode(tokens_BT),
        "y": g_star(tokens_BT),
        "w": np.full(B, 1.0 / B),
        "tokens": tokens_BT.astype(np.int8),
        "mask_pos": np.full(B, -1, np.int32),
        "mask_sign": np.zeros(B),
    }


def pretrain_population(T: int) -> Batch:
    """Every (string, masked position, mask sign) outcome once, uniform weights: T * C(T, T/2) * 2 rows."""
    check_length(T, enumerate_=True)
    strings_CT = balanced_strings(T)
    C = strings_CT.shape[0]
    tokens = np.repeat(strings_CT, 2 * T, axis=0)
    mask_pos = np.tile(np.repeat(np.arange(T), 2), C)
    mask_sign = np.tile(np.array([1.0, -1.0]), C * T)
    return _pretrain_batch(tokens, mask_pos, mask_sign)


def pretrain_sample(T: int, n: int, seed: int | np.random.Generator) -> Batch:
    """n i.i.d. draws from the pre-training distribution (weights 1/n)."""
    check_length(T)
    rng = np.random.default_rng(seed)
    base_T = np.array([OPEN] * (T // 2) + [CLOSE] * (T // 2), dtype=np.int8)
    tokens = rng.permuted(np.tile(base_T, (n, 1)), axis=1)
    mask_pos = rng.integers(0, T, size=n)
    mask_sign = rng.choice(np.array([1.0, -1.0]), size=n)
    return _pretrain_batch(tokens, mask_pos, mask_sign)


def downstream_population(T: int) -> Batch:
    """Every one of the 2^T strings once, uniform weights, target g*."""
    check_length(T, enumerate_=True)
    return _downstream_batch(all_strings(T))


def downstream_sample(T: int, n: int, seed: int | np.random.Generator) -> Batch:
    """n i.i.d. downstream strings (fair brackets), target g*, weights 1/n."""
    check_length(T)
    rng = np.random.default_rng(seed)
    return _downstream_batch(rng.integers(0, 2, size=(n, T)).astype(np.int8))


def expectation(values_B: np.ndarray, batch: Batch) -> float:
    """Weighted mean sum_b w_b v_b: the population expectation for an enumeration, the MC mean for a sample."""
    return float(np.sum(np.asarray(batch["w"]) * np.asarray(values_B)))


def mc_mean_stderr(values_B: np.ndarray) -> tuple[float, float]:
    """Monte-Carlo mean and its standard error (sample std / sqrt(n))."""
    v = np.asarray(values_B, dtype=np.float64)
    return float(v.mean()), float(v.std(ddof=1) / math.sqrt(v.size))


@dataclasses.dataclass(frozen=True)
class Dyck:
    """The pre-training language as a `flatlm.languages.Language`: uniform over balanced-count strings of length T."""

    length: int

    def __post_init__(self):
        check_length(self.length)

    @property
    def vocab_size(self) -> int:
        """V = 2: the brackets OPEN = 0 and CLOSE = 1."""
        return 2

    @property
    def max_length(self) -> int:
        """T: every sentence has exactly T brackets."""
        return self.length

    def sample(self, n: int, seed: int, latents: bool = True) -> Corpus:
        """n uniform balanced-count strings; latents hold a masked position and mask sign per string ({} with
        `latents=False`)."""
        b = pretrain_sample(self.length, n, seed)
        tokens = b["tokens"].astype(np.int32)
        latents = {"mask_pos": b["mask_pos"], "mask_sign": b["mask_sign"]} if latents else {}
        return Corpus(tokens=tokens, lengths=np.full(n, self.length, np.int32), latents=latents)

    def log_prob(self, tokens, lengths) -> np.ndarray:
        """-log C(T, T/2) (nats) for balanced-count strings of length T, -inf otherwise."""
        tokens = np.asarray(tokens)
        ok = (np.asarray(lengths) == self.length) & ((tokens == OPEN).sum(-1) == self.length // 2)
        return np.where(ok, -math.log(math.comb(self.length, self.length // 2)), -np.inf)

    def conditionals(self, tokens, lengths) -> np.ndarray:
        """q[b, t, w] = P(x_t = w | x_-t): one-hot on the forced bracket; NaN where the context is impossible,
        including every row of a sentence whose length is not the language's (it has probability 0, `log_prob`)."""
        tokens = np.asarray(tokens)
        T = self.length
        opens_B = (tokens[:, :T] == OPEN).sum(-1)
        opens_visible_BT = opens_B[:, None] - (tokens[:, :T] == OPEN)
        need_open_BT = T // 2 - opens_visible_BT  # 1 -> the masked bracket is open, 0 -> close
        q = np.full(tokens.shape[:1] + (T, 2), np.nan)
        q[..., OPEN] = np.where(need_open_BT == 1, 1.0, np.where(need_open_BT == 0, 0.0, np.nan))
        q[..., CLOSE] = 1.0 - q[..., OPEN]
        q[np.asarray(lengths) != T] = np.nan
        return q
