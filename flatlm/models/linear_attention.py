"""The one-layer linear transformer of the sparse contextual bigram setting (issue 19; Ren, Nichani, Wu & Lee 2024),
as pure functions of params {"V": [N, N], "A": [T, N]} (no optimizer here; `flatlm.train.linear_attention` trains it).

Parametrisation (this is flatlm's reading of the setting, written from `flatlm.languages.scb`, not copied from the
paper): the T context words x_1..x_T are one-hot columns X = [e_{x_1}, ..., e_{x_T}] in R^{N x T}; the last context
word k = x_T reads its attention over positions off column k of A, a = A e_k in R^T (no softmax: linear attention),
and the output is the value-weighted mixture

    y_hat = V X A e_{x_T} = sum_s A[s, x_T] V[:, x_s]  in R^N,

taken directly as the next-word probabilities (no softmax either). The ground truth is V = P (the transition,
columns on the simplex) and A = Q^T (column k = the pattern Q_k of last word k), where y_hat is exactly the SCB's
next-word distribution sum_s Q_{x_T}[s] P[:, x_s] (`truth_params`). y_hat is invariant under V -> cV, A -> A / c,
so `distance_to_truth` measures in the gauge where A's columns sum to 1 on average (as Q^T's do).

Losses (pure `loss(params, batch)`, batch = {"tokens": int32[B, >= T + 1]}, the target the word at position T):
`squared_loss` E||e_y - y_hat||^2 (population minimiser: y_hat = the next-word distribution, defined for any
sign of y_hat; what the trainer uses) and `cross_entropy` -log y_hat[y] (y_hat floored at `floor` > 0).
`exact_cross_entropy` and `exact_excess` compare y_hat with the exact next-word distribution q of given contexts.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

FLOOR = 1e-12  # log-probabilities of y_hat <= FLOOR are log(FLOOR): a linear output may leave the simplex


def next_word_probs(params, tokens_BL) -> jax.Array:
    """y_hat[B, N] = sum_s A[s, x_T] V[:, x_s] from the first T words of each row (not renormalised)."""
    V_NN, A_TN = params["V"], params["A"]
    T = A_TN.shape[0]
    ctx_BT = jnp.asarray(tokens_BL)[:, :T]
    a_BT = A_TN[:, ctx_BT[:, -1]].T  # attention of the last context word over the T positions
    values_BTN = V_NN.T[ctx_BT]  # V[:, x_s] for every position s
    return jnp.einsum("bt,btn->bn", a_BT, values_BTN)


def next_word_log_probs(params, tokens_BL, floor: float = FLOOR) -> jax.Array:
    """log max(y_hat, floor), float[B, N]: the model's next-word log-probabilities."""
    return jnp.log(jnp.maximum(next_word_probs(params, tokens_BL), floor))


def squared_loss(params, batch) -> jax.Array:
    """Mean over the batch of ||e_{x_{T+1}} - y_hat||^2 (the trainer's objective)."""
    T = params["A"].shape[0]
    y_hat_BN = next_word_probs(params, batch["tokens"])
    target_BN = jax.nn.one_hot(jnp.asarray(batch["tokens"])[:, T], y_hat_BN.shape[-1], dtype=y_hat_BN.dtype)
    return jnp.mean(jnp.sum((target_BN - y_hat_BN) ** 2, axis=-1))


def cross_entropy(params, batch, floor: float = FLOOR) -> jax.Array:
    """Mean over the batch of -log max(y_hat[x_{T+1}], floor), in nats."""
    T = params["A"].shape[0]
    logp_BN = next_word_log_probs(params, batch["tokens"], floor)
    return -jnp.mean(jnp.take_along_axis(logp_BN, jnp.asarray(batch["tokens"])[:, T, None], axis=1))


def exact_cross_entropy(params, tokens_BL, q_BN, floor: float = FLOOR) -> jax.Array:
    """Mean over contexts of -sum_w q(w) log y_hat(w) against the exact next-word distributions q[B, N] (terms with
    q = 0 dropped): the conditional entropy when y_hat = q."""
    logp_BN = next_word_log_probs(params, tokens_BL, floor)
    return -jnp.mean(jnp.sum(jnp.where(q_BN > 0, q_BN * logp_BN, 0.0), axis=-1))


def exact_excess(params, tokens_BL, q_BN) -> jax.Array:
    """Mean over contexts of ||y_hat - q||^2: the squared loss minus its minimum (the Bayes risk)."""
    return jnp.mean(jnp.sum((next_word_probs(params, tokens_BL) - q_BN) ** 2, axis=-1))


def truth_params(scb) -> dict:
    """The ground truth of an SCB in this parametrisation: V = P, A = Q^T (float64 numpy)."""
    return {"V": np.array(scb.transition), "A": np.array(scb.patterns).T}


def uniform_params(num_words: int, context_length: int, dtype=np.float32) -> dict:
    """The uninformed start: V = 1/N, A = 1/T everywhere (y_hat uniform, gradients non-zero; V = A = 0 is a saddle)."""
    return {"V": np.full((num_words, num_words), 1.0 / num_words, dtype),
            "A": np.full((context_length, num_words), 1.0 / context_length, dtype)}


def distance_to_truth(params, scb) -> dict:
    """Frobenius distances {"V": ||cV - P||, "A": ||A / c - Q^T||, "scale": c} with c = the mean column sum of A
    (the gauge of the ground truth, whose A columns sum to 1); c = 1 when that mean is 0."""
    V, A = np.asarray(params["V"], np.float64), np.asarray(params["A"], np.float64)
    truth = truth_params(scb)
    c = float(A.sum(0).mean())
    c = c if c != 0 else 1.0
    return {"V": float(np.linalg.norm(c * V - truth["V"])), "A": float(np.linalg.norm(A / c - truth["A"])),
            "scale": c}
