"""Section 4's mechanism on the Section 6 model: SGD flattens only where its gradient noise survives at the
optimum. The Dyck target is deterministic, so at a zero-loss point every per-sample gradient is zero and plain
SGD, like full-batch GD, stays put; with label noise (`TrainConfig.label_noise`: SGD on fresh samples of the
noisy-label task y + eps) the noise persists, its covariance is proportional to the Hessian there, and the iterate
drifts along the zero-loss set towards smaller Tr(H) (Theorem 4.3's flow, faster for larger lr / batch size).

`noise_run` runs `dyck_train.run_steps` from a zero-loss start and logs, every `log_every` steps, the
pre-training loss at the iterate and the exact Tr(H) at its Gauss-Newton projection onto the zero-loss set
(`project_to_zero_loss`), so the traces compared are all of zero-loss solutions."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.flatten_util import ravel_pytree

from flatlm.languages import dyck as lang
from flatlm.models import dyck as model
from flatlm.theory import dyck as th
from flatlm.theory.dyck_train import TrainConfig, run_steps

Params = model.Params
Batch = lang.Batch


@jax.jit
def _gauss_newton_step(params: Params, data: Batch) -> Params:
    """theta - J^+ r: the minimum-norm Newton step onto r(theta) = 0, r_b = sqrt(w_b) (f(x_b) - y_b)."""
    flat, unravel = ravel_pytree(params)
    resid = lambda t: jnp.sqrt(data["w"]) * (model.apply(unravel(t), data["x"]) - data["y"])
    J_NP = jax.jacfwd(resid)(flat)
    step_P = jnp.linalg.lstsq(J_NP, resid(flat))[0]
    return unravel(flat - step_P)


def project_to_zero_loss(params: Params, pretrain: Batch, steps: int = 20, tol: float = 1e-26) -> Params:
    """Gauss-Newton projection onto the zero-loss set (up to `steps` steps, until the loss is below `tol`): the
    nearby zero-loss solution, to first order the orthogonal projection. Run under jax.enable_x64()."""
    data = th._xyw(pretrain)
    for _ in range(steps):
        if th.pretrain_loss(params, pretrain) <= tol:
            break
        params = _gauss_newton_step(params, data)
    return params


def noise_run(start: Params, pretrain: Batch, cfg: TrainConfig, steps: int, log_every: int,
              key: jax.Array) -> dict[str, list]:
    """`steps` steps of `run_steps` (cfg: lr, batch_size 0 = full-batch GD, label_noise) from `start`; every
    `log_every` steps (and at 0) record step, loss (pre-training loss at the iterate), trace (exact Tr(H) at the
    iterate), trace_projected (exact Tr(H) at `project_to_zero_loss` of the iterate), loss_projected, alignment
    (of the projection) and distance (||theta - start||)."""
    data = th._xyw(pretrain)
    flat0 = ravel_pytree(start)[0]
    hist: dict[str, list] = {k: [] for k in ("step", "loss", "trace", "trace_projected", "loss_projected",
                                             "alignment", "distance")}

    def log(s, p):
        proj = project_to_zero_loss(p, pretrain)
        hist["step"].append(s)
        hist["loss"].append(th.pretrain_loss(p, pretrain))
        hist["trace"].append(th.exact_trace(p, pretrain))
        hist["trace_projected"].append(th.exact_trace(proj, pretrain))
        hist["loss_projected"].append(th.pretrain_loss(proj, pretrain))
        hist["alignment"].append(th.alignment(proj))
        hist["distance"].append(float(np.linalg.norm(np.asarray(ravel_pytree(p)[0] - flat0))))

    params, done = start, 0
    log(0, params)
    while done < steps:
        n = min(log_every, steps - done)
        params = run_steps(params, jax.random.split(jax.random.fold_in(key, done), n), data, cfg)
        done += n
        log(done, params)
    return hist


def label_noise_check(T: int, m: int, cfg: TrainConfig, steps: int, seed: int = 0, draw: str = "gaussian",
                      log_every: int = 0, progress=None) -> dict:
    """From the balanced random-feature solution of `seed` (zero loss, Tr(H) above the minimum): `steps` steps of
    cfg's SGD with and without cfg.label_noise, from the same start with the same mini-batches. Returns a JSON-ready
    dict: T, m, label_noise, lr, batch_size, flattest_trace, and `runs` {"sgd": history, "label_noise_sgd":
    history} (histories as `noise_run`'s). `progress(k)` is called after each logged chunk of k steps."""
    pretrain = lang.pretrain_population(T)
    start = th.random_feature_solution(jax.random.fold_in(jax.random.PRNGKey(seed), 1), T, m, pretrain,
                                       cfg.d_attn, draw=draw)
    log_every = log_every or max(1, steps // 10)
    runs = {}
    for name, noise in (("sgd", 0.0), ("label_noise_sgd", cfg.label_noise)):
        run_cfg = TrainConfig(lr=cfg.lr, batch_size=cfg.batch_size, label_noise=noise, d_attn=cfg.d_attn)
        runs[name] = noise_run(start, pretrain, run_cfg, steps, log_every, jax.random.PRNGKey(2000 + seed))
        if progress is not None:
            progress(steps)
    return {"T": T, "m": m, "seed": seed, "draw": draw, "label_noise": cfg.label_noise, "lr": cfg.lr,
            "batch_size": cfg.batch_size, "steps": steps, "flattest_trace": th.flattest_trace(T, m), "runs": runs}
