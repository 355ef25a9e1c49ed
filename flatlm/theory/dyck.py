"""Numerical check of Theorem 6.1 (Liu et al. 2023, Sec. 6): among zero-loss single-layer transformers on the
masked Dyck task, the flattest one (smallest Tr of the Hessian w.r.t. psi = (Q, K, V) and u) learns the
transferable feature and solves the downstream task from few samples; random-feature solutions fit pre-training
equally well but transfer worse.

Two constructed zero-loss solutions, width m, Q = K = 0 (uniform attention, a_1j = 1/T):
- transferable (any m >= 2, Theorem 6.1's condition): neurons +-c [1_T; 0_T] with u = -+c/sqrt(T). On pre-training
  inputs xbar = (1/T)(sum_{j != t} s_j e_j + sigma e_{t+T}), so 1_T . xbar = -y/T and f = y exactly. The scales
  satisfy Lemma D.1's AM-GM equality, giving Tr(H) = 4 / (m sqrt(T)), the lower bound
  2 E||grad f||^2 >= 4 E[|y| ||xbar||] / m >= 4 / (m sqrt(T)) (AM-GM per neuron; ||xbar||^2 >= 1/T for any
  attention), so this solution is the flattest zero-loss solution. (`flatlm.theory.dyck_search` searches for it.)
- random features: the paper's draw V_i ~ N(0, T I_2T) ("gaussian", default; needs m >= N/2 + 2T to interpolate)
  or mirrored pairs V = [W; -W] ("mirrored"; m >= 4T), u the minimum-norm interpolant of the pre-training
  population, and by default each neuron rescaled (v_i, u_i) -> (c_i v_i, u_i / c_i) to its own trace minimum
  (same f). See `random_feature_solution`. m >= 4T is a random-feature condition only.
Downstream step: keep psi, fit the minimum-norm head u on n downstream samples, report the population squared error
against g* (exact by enumeration for T <= MAX_ENUM_T). The SGD steps and the Tr(H) penalty of `train` are in
`flatlm.theory.dyck_train`.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from flatlm.errors import UserError
from flatlm.languages import dyck as lang
from flatlm.models import dyck as model
from flatlm.theory.dyck_trace import (  # noqa: F401  (re-exported: the check's public surface)
    EXACT_TRACE_BUDGET,
    _features_jit,
    _xyw,
    estimator_trace,
    exact_affordable,
    exact_trace,
    flattest_trace,
    gauss_newton_trace,
    pretrain_loss,
)
from flatlm.theory.dyck_train import TrainConfig, check_penalty_method, run_steps

Params = model.Params
Batch = lang.Batch


# ----------------------------------------------------------------------------------------------------------------
# The two constructed solutions.


def _check_width(m: int, need: int = 2, even: bool = False, what: str = "") -> None:
    if m < need or (even and m % 2):
        parity = "even and " if even else ""
        raise UserError(f"width m={m} must be {parity}>= {need}{what}; pass {parity.replace('and ', '')}--m of at "
                        f"least {need}")


def _zeros_qk(T: int, d_attn: int, dtype) -> tuple[jax.Array, jax.Array]:
    d = d_attn or 2 * T
    return jnp.zeros((d, 2 * T), dtype), jnp.zeros((d, 2 * T), dtype)


def transferable_solution(T: int, m: int, d_attn: int = 0, dtype=None) -> Params:
    """Solution (1) of Section 6 at any width m >= 2 (Theorem 6.1's condition): uniform attention, k+ = m - m//2
    neurons +c+ [1_T; 0_T] with u = -c+/sqrt(T) and k- = m//2 neurons -c- [1_T; 0_T] with u = +c-/sqrt(T),
    c+- = sqrt(m / k+-) T^(3/4) (the AM-GM equality |u_i| ||xbar|| = v_i.xbar of Lemma D.1; c = sqrt(2) T^(3/4)
    for even m). Zero loss and Tr(H) = 4 / (m sqrt(T)): the flattest zero-loss solution."""
    lang.check_length(T)
    _check_width(m)
    dtype = dtype or jnp.zeros(()).dtype
    k_pos, k_neg = m - m // 2, m // 2
    c_pos, c_neg = math.sqrt(m / k_pos) * T**0.75, math.sqrt(m / k_neg) * T**0.75
    dir_2T = np.concatenate([np.ones(T), np.zeros(T)])
    V = np.concatenate([np.tile(c_pos * dir_2T, (k_pos, 1)), np.tile(-c_neg * dir_2T, (k_neg, 1))])
    u = np.concatenate([np.full(k_pos, -c_pos / math.sqrt(T)), np.full(k_neg, c_neg / math.sqrt(T))])
    Q, K = _zeros_qk(T, d_attn, dtype)
    return {"Q": Q, "K": K, "V": jnp.asarray(V, dtype), "u": jnp.asarray(u, dtype)}


def fit_head(params: Params, batch: Batch) -> np.ndarray:
    """Minimum-norm u (float64) with (1/m) relu(V xbar) u = y on `batch` (least squares if it cannot interpolate)."""
    phi = np.asarray(_features_jit(params, jnp.asarray(batch["x"])), np.float64)
    m = phi.shape[1]
    u, *_ = np.linalg.lstsq(phi, m * np.asarray(batch["y"], np.float64), rcond=1e-8)
    return u


def balance_neurons(params: Params, batch: Batch) -> Params:
    """Rescale each neuron (v_i, u_i) -> (c_i v_i, u_i / c_i) to minimise its Gauss-Newton trace term; f is unchanged.

    Per neuron the term is c^2 E[relu(v.xbar)^2] + u^2 E[1(v.xbar > 0) ||xbar||^2] / c^2 (times 2/m^2), minimal at
    c^4 = u^2 E[1 ||xbar||^2] / E[relu^2]."""
    xbar = np.asarray(model.pooled(params, jnp.asarray(batch["x"])), np.float64)
    V = np.asarray(params["V"], np.float64)
    u = np.asarray(params["u"], np.float64)
    w = np.asarray(batch["w"], np.float64)
    pre = xbar @ V.T
    a_m = w @ np.maximum(pre, 0.0) ** 2
    b_m = u**2 * (w @ ((pre > 0) * np.sum(xbar**2, axis=1, keepdims=True)))
    c = np.where((a_m > 0) & (b_m > 0), (b_m / np.where(a_m > 0, a_m, 1.0)) ** 0.25, 1.0)
    dtype = params["V"].dtype
    return {**params, "V": jnp.asarray(V * c[:, None], dtype), "u": jnp.asarray(u / c, dtype)}


RF_DRAWS = ("gaussian", "mirrored")


def random_feature_min_width(T: int, draw: str = "gaussian") -> int:
    """The smallest width at which random features of `draw` fit the enumerated pre-training population exactly
    (for almost every draw, at uniform attention).

    "gaussian": relu(z) = (z + |z|) / 2, so relu features span the 2T linear functions plus one even function per
    +-pair of the N = 2 T C(T, T/2) pre-training inputs (xbar and -xbar are both inputs): rank N/2 + 2T (132 at
    T = 6; checked against the numerical rank in the tests), and a generic draw of that many neurons spans it.
    "mirrored": relu(w.x) - relu(-w.x) = w.x, so m/2 >= 2T pairs represent the linear target: m >= 4T."""
    check_draw(draw)
    return 4 * T if draw == "mirrored" else T * math.comb(T, T // 2) + 2 * T


def check_draw(draw: str) -> None:
    """Raise UserError unless `draw` is one of RF_DRAWS."""
    if draw not in RF_DRAWS:
        raise UserError(f"random-feature draw {draw!r} is unknown; use one of {', '.join(RF_DRAWS)}")


def random_feature_solution(key: jax.Array, T: int, m: int, pretrain: Batch, d_attn: int = 0,
                            v_std: float | None = None, balance: bool = True, draw: str = "gaussian",
                            dtype=None) -> Params:
    """Solution (2) of Section 6: uniform attention (Q = K = 0), random V, u the min-norm interpolant of `pretrain`.

    draw "gaussian" (default, the paper's: rows V_i ~ N(0, v_std^2 I), v_std = sqrt(T), i.e. N(0, T I_2T) of
    Section 6 and Theorem D.6) needs m >= `random_feature_min_width` (N/2 + 2T) to interpolate exactly;
    "mirrored" (V = [W; -W], W ~ N(0, v_std^2): the +-pairs make the linear target representable) needs an even
    m >= 4T. Either way a width below the need raises UserError naming it.
    balance (default True) rescales each neuron (v_i, u_i) -> (c_i v_i, u_i / c_i) to its own Tr(H) minimum: the
    same function, so the same pre-training and downstream losses, but without it a min-norm u (which ignores
    the V side of the trace) makes the table overstate the random features' Tr(H)."""
    lang.check_length(T)
    need = random_feature_min_width(T, draw)
    _check_width(m, need, even=draw == "mirrored", what=f" for {draw} random features at T={T}")
    dtype = dtype or jnp.zeros(()).dtype
    v_std = math.sqrt(T) if v_std is None else v_std
    rows = m // 2 if draw == "mirrored" else m
    W = v_std * np.asarray(jax.random.normal(key, (rows, 2 * T)), np.float64)
    V = np.concatenate([W, -W]) if draw == "mirrored" else W
    Q, K = _zeros_qk(T, d_attn, dtype)
    params = {"Q": Q, "K": K, "V": jnp.asarray(V, dtype), "u": jnp.zeros((m,), dtype)}
    params["u"] = jnp.asarray(fit_head(params, pretrain), dtype)
    residual = pretrain_loss(params, pretrain)
    if residual > 1e-6 * max(1.0, float(np.mean(np.asarray(pretrain["y"]) ** 2))):
        raise UserError(f"{draw} random features of width m={m} do not fit pre-training (loss {residual:.2e}); "
                        f"pass a larger --m (at least {need} fits the enumerated population)")
    return balance_neurons(params, pretrain) if balance else params


# ----------------------------------------------------------------------------------------------------------------
# Downstream step and feature diagnostics.


def downstream_loss(params: Params, train: Batch, test: Batch) -> float:
    """Population squared error of the min-norm head fitted on `train` over psi's features, against g* on `test`."""
    u = fit_head(params, train)
    phi = np.asarray(_features_jit(params, jnp.asarray(test["x"])), np.float64)
    err = phi @ u / u.shape[0] - np.asarray(test["y"], np.float64)
    return lang.expectation(err**2, test)


def alignment(params: Params) -> float:
    """How much V's rows look like +-[1_T; 0_T]: mean |cos| weighted by |u_i| ||v_i|| (1 for the transferable one)."""
    V = np.asarray(params["V"], np.float64)
    u = np.asarray(params["u"], np.float64)
    T = V.shape[1] // 2
    norms = np.linalg.norm(V, axis=1)
    cos = np.abs(V[:, :T].sum(axis=1)) / (math.sqrt(T) * np.maximum(norms, 1e-30))
    weight = np.abs(u) * norms
    return float(np.sum(weight * cos) / np.sum(weight)) if np.sum(weight) > 0 else 0.0


def evaluate(params: Params, pretrain: Batch, down_train: list[Batch], down_test: Batch, key: jax.Array,
             num_probes: int = 64, exact: bool = True) -> dict[str, Any]:
    """One table row: pretrain_loss; trace (the exact one, else the Hutchinson mean, else None); trace_exact;
    trace_gauss_newton (2 E||grad f||^2); trace_hutchinson {mean, stderr, num_probes} (num_probes > 0);
    downstream_loss (mean over the `down_train` draws); alignment."""
    out = {
        "pretrain_loss": pretrain_loss(params, pretrain),
        "trace_exact": exact_trace(params, pretrain) if exact else None,
        "trace_gauss_newton": gauss_newton_trace(params, pretrain),
        "downstream_loss": float(np.mean([downstream_loss(params, tr, down_test) for tr in down_train])),
        "alignment": alignment(params),
    }
    if num_probes:
        est = estimator_trace(params, pretrain, key, num_probes)
        out["trace_hutchinson"] = {"mean": est.mean, "stderr": est.stderr, "num_probes": num_probes}
    out["trace"] = out["trace_exact"] if exact else out.get("trace_hutchinson", {}).get("mean")
    return out


# ----------------------------------------------------------------------------------------------------------------
# Training from random initialisation: SGD, optionally with an explicit Tr(H) penalty (the steps and the penalty
# are in flatlm.theory.dyck_train; here the loop that logs the population quantities between them).


def train(key: jax.Array, T: int, m: int, cfg: TrainConfig, pretrain: Batch, down_train: list[Batch],
          down_test: Batch, progress: Callable[[int], None] | None = None) -> tuple[Params, dict[str, list]]:
    """Train from a Gaussian init; every `log_every` steps record the step, the population pre-training loss,
    Tr(H) (exact; None where `exact_affordable` says no), its Gauss-Newton part 2 E||grad f||^2 (= Tr(H) at zero
    loss), the alignment of V's rows with +-1_T and the downstream loss. `progress(k)` is called after k steps."""
    check_penalty_method(cfg.penalty_method)
    k_init, k_run = jax.random.split(key)
    params = model.init_params(k_init, T, m, cfg.d_attn, cfg.v_std, cfg.u_std, cfg.qk_std)
    data = _xyw(pretrain)
    use_exact = exact_affordable(params, pretrain)
    keys_logged = ("step", "pretrain_loss", "trace", "trace_gauss_newton", "alignment", "downstream_loss")
    history: dict[str, list] = {k: [] for k in keys_logged}

    def log(s, params):
        loss_val = pretrain_loss(params, pretrain)
        if not math.isfinite(loss_val):
            raise FloatingPointError(f"pre-training loss is {loss_val} at step {s}; lower the learning rate")
        history["step"].append(s)
        history["pretrain_loss"].append(loss_val)
        history["trace"].append(exact_trace(params, pretrain) if use_exact else None)
        history["trace_gauss_newton"].append(gauss_newton_trace(params, pretrain))
        history["alignment"].append(alignment(params))
        history["downstream_loss"].append(float(np.mean([downstream_loss(params, tr_b, down_test)
                                                         for tr_b in down_train])))

    keys = jax.random.split(k_run, cfg.steps + 1)
    log(0, params)
    done = 0
    while done < cfg.steps:
        n = min(cfg.log_every, cfg.steps - done)
        params = run_steps(params, keys[done + 1:done + 1 + n], data, cfg)
        done += n
        log(done, params)
        if progress is not None:
            progress(n)
    return params, history


# ----------------------------------------------------------------------------------------------------------------
# The whole check, as the CLI runs it.


def populations(T: int, samples: int = 0, seed: int = 0) -> tuple[Batch, Batch, bool]:
    """Pre-training and downstream test batches: exact enumerations, or `samples` draws each when samples > 0."""
    lang.check_length(T, enumerate_=samples <= 0)
    if samples > 0:
        return lang.pretrain_sample(T, samples, seed), lang.downstream_sample(T, samples, seed + 1), False
    return lang.pretrain_population(T), lang.downstream_population(T), True


def run_check(T: int = 6, m: int = 0, seeds: Sequence[int] = (0, 1, 2), steps: int = 3000, n_downstream: int = 16,
              samples: int = 0, train_cfg: TrainConfig | None = None, num_probes: int = 64, balance: bool = True,
              draw: str = "gaussian", progress: Callable[[int], None] | None = None) -> dict[str, Any]:
    """The whole check: the transferable solution and (where the width allows) random features of `draw` for
    every seed, then (steps > 0) an SGD run and an SGD + Tr(H) penalty run (penalty = train_cfg.penalty, skipped
    if 0) from the same random init of the first seed.

    Any m >= 2 is allowed (Theorem 6.1 needs only m >= 2); m = 0 means `random_feature_min_width(T, draw)` (the
    smallest width at which the random features fit; 132 at T = 6 for the default gaussian draw, 4T for mirrored).
    Below that width the random-feature rows are left out and `random_features_note` says why. Returns a
    JSON-ready dict: the settings, `solutions` (one row per solution and seed, see `evaluate`) and `training`."""
    check_draw(draw)
    rf_need = random_feature_min_width(T, draw) if T >= 2 and T % 2 == 0 else 2
    m = m or rf_need + (draw == "mirrored" and rf_need % 2)
    lang.check_length(T, enumerate_=samples <= 0)
    _check_width(m)
    rf_note = None
    if m < rf_need or (draw == "mirrored" and m % 2):
        rf_note = (f"random features ({draw}) left out: they need {'an even' if draw == 'mirrored' else 'a'} "
                   f"width m >= {rf_need} at T={T}, got m={m}")
    if not seeds:
        raise UserError("no seeds given; pass --seeds 0 1 2")
    if n_downstream < 1:
        raise UserError(f"--n-downstream {n_downstream} must be >= 1")
    if steps < 0:
        raise UserError(f"--steps {steps} must be >= 0")
    cfg = dataclasses.replace(train_cfg or TrainConfig(), steps=steps)
    if cfg.lr <= 0 or cfg.batch_size < 1 or cfg.log_every < 1:
        raise UserError("--lr, --batch-size and the log interval must be positive")
    check_penalty_method(cfg.penalty_method)
    pretrain, down_test, enumerated = populations(T, samples)
    d = cfg.d_attn or 2 * T
    num_params = 2 * d * 2 * T + m * 2 * T + m
    exact = num_params * pretrain["x"].size <= EXACT_TRACE_BUDGET
    down_train = {s: [lang.downstream_sample(T, n_downstream, 10_000 + s)] for s in seeds}
    rows = []
    sol1 = transferable_solution(T, m, cfg.d_attn)
    sol1_eval = evaluate(sol1, pretrain, down_train[seeds[0]], down_test, jax.random.PRNGKey(seeds[0]), num_probes,
                         exact)
    for s in seeds:
        key = jax.random.PRNGKey(s)
        # The transferable solution does not depend on the seed; only its downstream samples do.
        down = float(np.mean([downstream_loss(sol1, tr, down_test) for tr in down_train[s]]))
        rows.append({"solution": "transferable", "seed": s, **sol1_eval, "downstream_loss": down})
        if rf_note is None:
            sol2 = random_feature_solution(jax.random.fold_in(key, 1), T, m, pretrain, cfg.d_attn, balance=balance,
                                           draw=draw)
            rows.append({"solution": "random_features", "seed": s,
                         **evaluate(sol2, pretrain, down_train[s], down_test, key, num_probes, exact)})
    training = {}
    runs = [("sgd", 0.0)] + ([("sgd_trace_penalty", cfg.penalty)] if cfg.penalty > 0 else [])
    for name, pen in runs if steps > 0 else []:
        s = seeds[0]
        params, hist = train(jax.random.PRNGKey(1000 + s), T, m, dataclasses.replace(cfg, penalty=pen), pretrain,
                             down_train[s], down_test, progress)
        training[name] = {"seed": s, "penalty": pen, "history": hist}
        rows.append({"solution": name, "seed": s,
                     **evaluate(params, pretrain, down_train[s], down_test, jax.random.PRNGKey(s), num_probes,
                                exact)})
    return {
        "T": T, "m": m, "d_attn": d, "seeds": list(seeds), "steps": steps, "n_downstream": n_downstream,
        "enumerated": enumerated, "samples": samples, "balance": balance, "draw": draw,
        "random_features_note": rf_note, "num_params": num_params,
        "flattest_trace": flattest_trace(T, m), "train_config": dataclasses.asdict(cfg), "solutions": rows,
        "training": training,
    }
