"""Numerical check of Theorem 6.1 (Liu et al. 2023, Sec. 6): among zero-loss single-layer transformers on the
masked Dyck task, the flattest one (smallest Tr of the Hessian w.r.t. psi = (Q, K, V) and u) learns the
transferable feature and solves the downstream task from few samples; random-feature solutions fit pre-training
equally well but transfer worse.

Two constructed zero-loss solutions, width m (even), Q = K = 0 (uniform attention, a_1j = 1/T):
- transferable: half the neurons v = +c [1_T; 0_T], half v = -c [1_T; 0_T], u = -+2T/c. On pre-training inputs
  xbar = (1/T)(sum_{j != t} s_j e_j + sigma e_{t+T}), so 1_T . xbar = -y/T and f = y exactly. The scale
  c = sqrt(2) T^(3/4) minimises Tr(H) over the rescalings (V, u) -> (cV, u/c), giving Tr(H) = 4 / (m sqrt(T)), which
  is the lower bound 2 E||grad f||^2 >= 4 E[|y| ||xbar||] / m >= 4 / (m sqrt(T)) (AM-GM per neuron; ||xbar||^2 >= 1/T
  for any attention), so this solution is the flattest zero-loss solution.
- random features: V = [W; -W], W ~ N(0, v_std^2) [m/2, 2T] (v_std = sqrt(T) by default, so pre-activations are
  O(1)), u the minimum-norm interpolant of the pre-training population. The +-pairs make the (linear) target
  representable; m >= 4T makes it representable for almost every W. `balance=True` rescales each neuron
  (v_i, u_i) -> (c_i v_i, u_i / c_i) to its own trace minimum, which leaves f unchanged.
Downstream step: keep psi, fit the minimum-norm head u on n downstream samples, report the population squared error
against g* (exact by enumeration for T <= MAX_ENUM_T). The SGD steps and the Tr(H) penalty of `train` are in
`flatlm.theory.dyck_train`.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.flatten_util import ravel_pytree

from flatlm.errors import UserError
from flatlm.flatness import hessian
from flatlm.languages import dyck as lang
from flatlm.models import dyck as model
from flatlm.theory.dyck_train import TrainConfig, check_penalty_method, gauss_newton, run_steps

Params = model.Params
Batch = lang.Batch


# ----------------------------------------------------------------------------------------------------------------
# Trace of the Hessian: an exact trace of our own (independent of flatlm.flatness), and the shared estimators.


@functools.partial(jax.jit, static_argnames=("chunk",))
def _exact_trace_hvp(params: Params, batch: Batch, chunk: int = 64) -> jax.Array:
    """sum_i e_i^T H e_i: `chunk` basis vectors at a time (vmapped HVPs), the chunks scanned."""
    flat, unravel = ravel_pytree(params)
    grad_fn = jax.grad(model.flat_loss(unravel, batch))
    P = flat.shape[0]
    num_chunks = -(-P // chunk)
    idx_CK = jnp.arange(num_chunks * chunk).reshape(num_chunks, chunk)

    def diag_entry(i):
        e_P = (jnp.arange(P) == i).astype(flat.dtype)  # all zeros for the padding indices i >= P
        return jax.jvp(grad_fn, (flat,), (e_P,))[1] @ e_P

    return jnp.sum(jax.lax.map(jax.vmap(diag_entry), idx_CK))


@jax.jit
def _exact_trace_dense(params: Params, batch: Batch) -> jax.Array:
    flat, unravel = ravel_pytree(params)
    return jnp.trace(jax.hessian(model.flat_loss(unravel, batch))(flat))


def _xyw(batch: Batch) -> Batch:
    """The arrays the loss reads (so jit caches on them alone)."""
    return {k: jnp.asarray(batch[k]) for k in ("x", "y", "w")}


def exact_trace(params: Params, batch: Batch, method: str = "hvp") -> float:
    """Exact Tr of the Hessian of the loss on `batch` w.r.t. all of (Q, K, V, u).

    method "hvp": sum of e_i^T H e_i over the P basis vectors, in chunks (memory: 64 copies of the activations);
    "hessian": trace of the dense jax.hessian (memory: P copies; tiny models only)."""
    if method == "hessian":
        return float(_exact_trace_dense(params, _xyw(batch)))
    return float(_exact_trace_hvp(params, _xyw(batch)))


EXACT_TRACE_BUDGET = 3e8  # P * rows * T * 2T: about 10 s of HVPs on one CPU core (T <= 8 at the default widths)


def exact_affordable(params: Params, batch: Batch) -> bool:
    """Whether `exact_trace` is cheap enough here: P HVPs, each over the whole batch."""
    num_params = ravel_pytree(params)[0].shape[0]
    return num_params * int(np.prod(np.shape(batch["x"]))) <= EXACT_TRACE_BUDGET


def estimator_trace(params: Params, batch: Batch, key: jax.Array, num_probes: int = 64,
                    method: str = "hutchinson"):
    """Tr(H) from the shared flatness estimators (`flatlm.flatness.hessian`): a TraceEstimate (.mean, .stderr).

    method "hutchinson" (Rademacher probes) or "exact" (its jax.hessian path, stderr 0)."""
    b = _xyw(batch)
    if method == "exact":
        return hessian.exact_trace(model.loss, params, batches=[b])
    return hessian.hutchinson_trace(model.loss, params, key, num_probes, batches=[b],
                                    chunk_size=min(16, num_probes))


def pretrain_loss(params: Params, batch: Batch) -> float:
    """The (population, for an enumerated batch) squared loss, jitted."""
    return float(_loss_jit(params, _xyw(batch)))


_loss_jit = jax.jit(model.loss)
_features_jit = jax.jit(model.features)


@jax.jit
def _gauss_newton_jit(params: Params, batch: Batch) -> jax.Array:
    return gauss_newton(params, batch)


def gauss_newton_trace(params: Params, batch: Batch) -> float:
    """2 sum_b w_b ||grad_theta f(x_b)||^2: equals Tr(H) at a zero-loss point (the residual term vanishes)."""
    return float(_gauss_newton_jit(params, _xyw(batch)))


def flattest_trace(T: int, m: int) -> float:
    """The smallest Tr(H) of any zero-loss solution of width m: 4 / (m sqrt(T)) (attained by the transferable one;
    the lower bound of the module docstring, cf. Lemma D.1 in Appendix D.1)."""
    return 4.0 / (m * math.sqrt(T))


# ----------------------------------------------------------------------------------------------------------------
# The two constructed solutions.


def _check_width(T: int, m: int, need: int = 2) -> None:
    if m < need or m % 2:
        raise UserError(f"width m={m} must be even and >= {need}; pass an even --m of at least {need}")


def _zeros_qk(T: int, d_attn: int, dtype) -> tuple[jax.Array, jax.Array]:
    d = d_attn or 2 * T
    return jnp.zeros((d, 2 * T), dtype), jnp.zeros((d, 2 * T), dtype)


def transferable_solution(T: int, m: int, d_attn: int = 0, dtype=None) -> Params:
    """Solution (1) of Section 6: uniform attention, neurons +-c [1_T; 0_T] with c = sqrt(2) T^(3/4), u = -+2T/c
    (zero loss; the flattest zero-loss solution, Theorem 6.1)."""
    lang.check_length(T)
    _check_width(T, m)
    dtype = dtype or jnp.zeros(()).dtype
    c = math.sqrt(2.0) * T**0.75
    half = m // 2
    dir_2T = np.concatenate([np.ones(T), np.zeros(T)])
    V = np.concatenate([np.tile(c * dir_2T, (half, 1)), np.tile(-c * dir_2T, (half, 1))])
    u = np.concatenate([np.full(half, -2.0 * T / c), np.full(half, 2.0 * T / c)])
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


def random_feature_solution(key: jax.Array, T: int, m: int, pretrain: Batch, d_attn: int = 0,
                            v_std: float | None = None, balance: bool = False, dtype=None) -> Params:
    """Solution (2) of Section 6: uniform attention, V = [W; -W] with W ~ N(0, v_std^2), u the min-norm interpolant
    of `pretrain` (random features fit pre-training: Theorem D.6, Appendix D.2)."""
    lang.check_length(T)
    _check_width(T, m, need=4 * T)
    dtype = dtype or jnp.zeros(()).dtype
    v_std = math.sqrt(T) if v_std is None else v_std
    W = v_std * np.asarray(jax.random.normal(key, (m // 2, 2 * T)), np.float64)
    Q, K = _zeros_qk(T, d_attn, dtype)
    params = {"Q": Q, "K": K, "V": jnp.asarray(np.concatenate([W, -W]), dtype), "u": jnp.zeros((m,), dtype)}
    params["u"] = jnp.asarray(fit_head(params, pretrain), dtype)
    residual = pretrain_loss(params, pretrain)
    if residual > 1e-6 * max(1.0, float(np.mean(np.asarray(pretrain["y"]) ** 2))):
        raise UserError(f"random features of width m={m} do not fit pre-training (loss {residual:.2e}); "
                        f"pass a larger --m (at least {4 * T})")
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
              samples: int = 0, train_cfg: TrainConfig | None = None, num_probes: int = 64, balance: bool = False,
              progress: Callable[[int], None] | None = None) -> dict[str, Any]:
    """The whole check: both constructed solutions for every seed, then (steps > 0) an SGD run and an SGD + Tr(H)
    penalty run (penalty = train_cfg.penalty, skipped if 0) from the same random init of the first seed.

    m = 0 means 4T (the smallest width at which random features fit for almost every draw). Returns a JSON-ready
    dict: the settings, `solutions` (one row per solution and seed, see `evaluate`) and `training` histories."""
    m = m or 4 * T
    lang.check_length(T, enumerate_=samples <= 0)
    _check_width(T, m, need=4 * T)
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
        sol2 = random_feature_solution(jax.random.fold_in(key, 1), T, m, pretrain, cfg.d_attn, balance=balance)
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
        "enumerated": enumerated, "samples": samples, "balance": balance, "num_params": num_params,
        "flattest_trace": flattest_trace(T, m), "train_config": dataclasses.asdict(cfg), "solutions": rows,
        "training": training,
    }
