"""The search Theorem 6.1 is about: minimise Tr(H) of the pre-training loss over the zero-loss set of the
Section 6 model, from many random starts, and see what the minimisers transfer.

Problem: minimise Tr(H)(theta) subject to r(theta) = 0, r_b = sqrt(w_b) (f(x_b) - y_b) over the enumerated
pre-training population. On the zero-loss set Tr(H) = 2 E||grad f||^2 (the Gauss-Newton part; Lemma D.4), which
is smooth and bounded below everywhere, so the search minimises that (`dyck_train.gauss_newton`) and reports the
exact Tr(H) at the end. Method: an augmented Lagrangian with continuation,
    A(theta; lam, mu) = GN(theta) + lam . r(theta) + mu |r(theta)|^2,
`inner_steps` L-BFGS steps (optax.lbfgs, zoom line search) per round, then lam <- lam + 2 mu r and
mu <- min(mu * mu_growth, mu_max). A start counts as a zero-loss solution when its pre-training loss is below
`feasible_tol`; the others (typically: every active neuron with the same sign of u, so half the inputs cannot be
fitted) are reported but left out of the minimum.

Reported per start: the pre-training loss, the exact Tr(H) (dense jax.hessian, or the HVP trace when that is too
big), its gap to the closed-form minimum 4 / (m sqrt T) (`flattest_trace`, Lemma D.1), the alignment of V's rows
with +-1_T, the attention's distance from uniform, and the downstream loss of the min-norm head fitted on n
downstream samples, for every n in `ns` and every downstream seed (Theorem 6.1: zero with probability >= 1 - 2^-n
for the flattest solutions).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from flatlm.errors import UserError
from flatlm.languages import dyck as lang
from flatlm.models import dyck as model
from flatlm.theory import dyck as th
from flatlm.theory.dyck_trace import _xyw, exact_affordable, exact_trace, flattest_trace, pretrain_loss
from flatlm.theory.dyck_train import gauss_newton

Params = model.Params
Batch = lang.Batch
SUCCESS_TOL = 1e-8  # a downstream loss below this counts as a zero-loss transfer


@dataclasses.dataclass(frozen=True)
class SearchConfig:
    """Settings of `search`: `starts` random inits (Gaussian, `model.init_params` with these stds; d_attn 0 means
    2T), the augmented-Lagrangian schedule (rounds x inner_steps L-BFGS steps, penalty mu0 growing by mu_growth up
    to mu_max), the zero-loss threshold, and the downstream evaluation (sample sizes `ns`, `down_seeds` draws of
    each)."""

    starts: int = 16
    d_attn: int = 0
    v_std: float = 1.0
    u_std: float = 1.0
    qk_std: float = 0.5
    rounds: int = 12
    inner_steps: int = 300
    mu0: float = 1.0
    mu_growth: float = 3.0
    mu_max: float = 1e4
    feasible_tol: float = 1e-12
    ns: tuple[int, ...] = (1, 2, 4, 8, 16, 32)
    down_seeds: tuple[int, ...] = (0, 1, 2, 3, 4)


def check_config(cfg: SearchConfig) -> None:
    """Raise UserError on settings the search cannot run with."""
    if cfg.starts < 1:
        raise UserError(f"--search {cfg.starts}: pass the number of random starts, at least 1")
    if cfg.rounds < 1 or cfg.inner_steps < 1 or cfg.mu0 <= 0 or cfg.mu_growth < 1:
        raise UserError("the search schedule needs rounds, inner steps and mu0 > 0 and mu_growth >= 1")
    if not cfg.ns or min(cfg.ns) < 1 or not cfg.down_seeds:
        raise UserError("pass downstream sample sizes >= 1 (--search-n 2 4 8) and at least one seed")


def _residual(params: Params, data: Batch) -> jax.Array:
    return jnp.sqrt(data["w"]) * (model.apply(params, data["x"]) - data["y"])


def _augmented(params: Params, data: Batch, lam: jax.Array, mu: jax.Array) -> jax.Array:
    r = _residual(params, data)
    return gauss_newton(params, data) + lam @ r + mu * (r @ r)


@functools.partial(jax.jit, static_argnames=("steps",))
def _inner(params: Params, data: Batch, lam: jax.Array, mu: jax.Array, steps: int) -> Params:
    """`steps` L-BFGS steps on the augmented Lagrangian at fixed (lam, mu)."""
    fn = functools.partial(_augmented, data=data, lam=lam, mu=mu)
    opt = optax.lbfgs()
    value_and_grad = optax.value_and_grad_from_state(fn)

    def step(carry, _):
        p, state = carry
        value, grad = value_and_grad(p, state=state)
        updates, state = opt.update(grad, state, p, value=value, grad=grad, value_fn=fn)
        return (optax.apply_updates(p, updates), state), None

    return jax.lax.scan(step, (params, opt.init(params)), None, length=steps)[0][0]


_residual_jit = jax.jit(_residual)


def search_one(key: jax.Array, T: int, m: int, pretrain: Batch, cfg: SearchConfig) -> Params:
    """One start: Gaussian init from `key`, then the augmented-Lagrangian rounds; returns the final parameters."""
    data = _xyw(pretrain)
    params = model.init_params(key, T, m, cfg.d_attn, cfg.v_std, cfg.u_std, cfg.qk_std)
    lam = jnp.zeros_like(data["y"])
    mu = cfg.mu0
    for _ in range(cfg.rounds):
        params = _inner(params, data, lam, jnp.asarray(mu, data["y"].dtype), cfg.inner_steps)
        r = _residual_jit(params, data)
        lam = lam + 2.0 * mu * r
        mu = min(mu * cfg.mu_growth, cfg.mu_max)
    return params


def attention_spread(params: Params, pretrain: Batch) -> float:
    """max_b,j |a_1j - 1/T| over the pre-training inputs (0 for uniform attention, Lemma D.1's condition (5))."""
    a_BT = np.asarray(jax.jit(model.attention)(params, jnp.asarray(pretrain["x"])))
    return float(np.max(np.abs(a_BT - 1.0 / a_BT.shape[1])))


def downstream_table(params: Params, T: int, ns, seeds, down_test: Batch) -> dict[str, list[float]]:
    """{str(n): [downstream loss of the min-norm head fitted on n samples, one per seed]} (sample seed
    10_000 * n + seed, the same draws for every solution)."""
    return {str(n): [th.downstream_loss(params, lang.downstream_sample(T, n, 10_000 * n + s), down_test)
                     for s in seeds] for n in ns}


def describe(params: Params, T: int, m: int, pretrain: Batch, down_test: Batch, cfg: SearchConfig) -> dict:
    """One row of the search table for `params` (see the module docstring)."""
    bound = flattest_trace(T, m)
    method = "hessian" if exact_affordable(params, pretrain) and m * 2 * T <= 4096 else "hvp"
    loss_val = pretrain_loss(params, pretrain)
    trace = exact_trace(params, pretrain, method=method)
    down = downstream_table(params, T, cfg.ns, cfg.down_seeds, down_test)
    return {
        "pretrain_loss": loss_val, "feasible": bool(loss_val <= cfg.feasible_tol), "trace": trace,
        "trace_gap": trace / bound - 1.0, "alignment": th.alignment(params),
        "attention_spread": attention_spread(params, pretrain),
        "downstream": down, "downstream_mean": {n: float(np.mean(v)) for n, v in down.items()},
    }


def success_probability(T: int, n: int) -> float:
    """P(the flattest solution's min-norm head on n downstream samples has zero population loss), exactly.

    Its features are relu(-+c g*(x) / T): the head fits g* on the population iff the sample holds an x with
    g* > 0 and one with g* < 0, so P = 1 - 2 q^n + z^n, z = P(g* = 0) = C(T, T/2) / 2^T, q = P(g* >= 0) = (1 + z)/2.
    (Theorem 6.1 states 1 - 2^-n, which ignores g* = 0: 0.64 against 0.94 at T = 6, n = 4.)"""
    z = math.comb(T, T // 2) / 2.0**T
    q = (1.0 + z) / 2.0
    return 1.0 - 2.0 * q**n + z**n


def search(T: int = 6, m: int = 2, cfg: SearchConfig | None = None, seed: int = 0,
           progress: Callable[[int], None] | None = None) -> dict[str, Any]:
    """The whole search on the enumerated population: `cfg.starts` starts (start i from fold_in(PRNGKey(seed), i)),
    each described as in `describe`, plus the transferable solution as the reference. Returns a JSON-ready dict:
    bound (4 / (m sqrt T)), rows (one per start), reference, and the summary: n_feasible, min_trace (over zero-loss
    starts; None if none), min_gap (min_trace / bound - 1), n_at_bound (gap <= 1e-3) and the downstream mean loss
    per n over the starts at the bound and over the other zero-loss starts. Run it under jax.enable_x64()."""
    cfg = cfg or SearchConfig()
    check_config(cfg)
    lang.check_length(T, enumerate_=True)
    if m < 1:
        raise UserError(f"width m={m} must be >= 1; pass --m 2 or more")
    pretrain, down_test = lang.pretrain_population(T), lang.downstream_population(T)
    bound = flattest_trace(T, m)
    rows = []
    for i in range(cfg.starts):
        params = search_one(jax.random.fold_in(jax.random.PRNGKey(seed), i), T, m, pretrain, cfg)
        rows.append({"start": i, **describe(params, T, m, pretrain, down_test, cfg)})
        if progress is not None:
            progress(1)
    reference = describe(th.transferable_solution(T, m, cfg.d_attn), T, m, pretrain, down_test, cfg) \
        if m >= 2 else None
    feasible = [r for r in rows if r["feasible"]]
    at_bound = [r for r in feasible if r["trace_gap"] <= 1e-3]
    others = [r for r in feasible if r["trace_gap"] > 1e-3]

    def mean_down(rs):
        return {str(n): float(np.mean([r["downstream_mean"][str(n)] for r in rs])) for n in cfg.ns} if rs else None

    min_trace = min((r["trace"] for r in feasible), default=None)
    return {
        "T": T, "m": m, "seed": seed, "config": dataclasses.asdict(cfg), "bound": bound, "rows": rows,
        "reference": reference, "n_feasible": len(feasible), "n_at_bound": len(at_bound),
        "min_trace": min_trace, "min_gap": None if min_trace is None else min_trace / bound - 1.0,
        "downstream_at_bound": mean_down(at_bound), "downstream_above_bound": mean_down(others),
        "theorem_success_probability": {str(n): 1.0 - 2.0**-n for n in cfg.ns},  # as Theorem 6.1 states it
        "success_probability": {str(n): success_probability(T, n) for n in cfg.ns},  # exact, flattest solution
        "success_tol": SUCCESS_TOL,
    }
