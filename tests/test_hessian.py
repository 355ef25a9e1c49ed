"""flatlm.flatness.hessian: HVPs against jax.hessian, Hutchinson / Hutch++ against exact traces, and agreement
between one device and a simulated 8-device mesh."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import xla_flags
from flatness_tiny import fast_compile, float64_everywhere, mlm_batch, tiny_bert, tiny_lstm
from jax.flatten_util import ravel_pytree

from flatlm.errors import UserError
from flatlm.flatness import compare
from flatlm.flatness import hessian as hs
from flatlm.flatness.estimates import TraceEstimate
from flatlm.models.losses import mlm_loss


@pytest.fixture(autouse=True, scope="module")
def _fast_compile():
    with fast_compile():
        yield


def _case(make):
    with float64_everywhere():
        model, params = make()
        batch = mlm_batch(0)
        loss = lambda p: mlm_loss(p, batch, model.apply)
        H, _ = hs.exact_hessian(loss, params)
        return model, params, loss, np.asarray(H)


@pytest.fixture(scope="module")
def bert_case():
    return _case(tiny_bert)


@pytest.fixture(scope="module")
def bert_hutchinson(bert_case):
    _, params, loss, _ = bert_case
    with float64_everywhere():
        return hs.hutchinson_trace(loss, params, jax.random.key(0), 2000, chunk_size=250, groups="block")


def _toy_params():
    rng = np.random.default_rng(0)
    return {"a": jnp.asarray(rng.normal(size=(3, 4))), "b": {"c": jnp.asarray(rng.normal(size=(5,)))},
            "d": jnp.asarray(rng.normal(size=(2, 2)))}


def _toy_loss(params, batch):
    """Non-quadratic loss whose Hessian changes with the batch: 0.5 x.Ax + s.cos(x) + (u.x)^2 + 0.1 sum x^4."""
    x, _ = ravel_pytree(params)
    return 0.5 * x @ batch["A"] @ x + batch["s"] @ jnp.cos(x) + (batch["u"] @ x) ** 2 + 0.1 * jnp.sum(x**4)


def _toy_batches(n: int, P: int = 21):
    rng = np.random.default_rng(1)
    M = rng.normal(size=(P, P))
    A = M + M.T
    return [{"A": jnp.asarray(A), "s": jnp.asarray(rng.normal(size=P)), "u": jnp.asarray(rng.normal(size=P))}
            for _ in range(n)]


@pytest.mark.parametrize("make", [tiny_bert, tiny_lstm], ids=["bert", "lstm"])
def test_hvp_equals_hessian_times_v(make, bert_case):
    model, params, loss, H = bert_case if make is tiny_bert else _case(make)
    with float64_everywhere():
        for kind in ("gaussian", "rademacher"):
            v = hs.probe_like(jax.random.key(3), params, kind)
            hv = jax.jit(hs.hvp, static_argnums=0)(loss, params, v)
            assert jax.tree.structure(hv) == jax.tree.structure(params)
            np.testing.assert_allclose(ravel_pytree(hv)[0], H @ ravel_pytree(v)[0], rtol=0, atol=1e-10)


def test_probe_like_is_independent_per_leaf():
    params = {"w1": jnp.zeros((64, 32)), "w2": jnp.zeros((64, 32)), "b": jnp.zeros((7,), jnp.bfloat16)}
    v = hs.probe_like(jax.random.key(0), params)
    assert v["b"].dtype == jnp.bfloat16 and v["w1"].shape == (64, 32)
    assert set(np.unique(np.asarray(v["w1"]))) == {-1.0, 1.0}
    assert abs(float(jnp.mean(v["w1"] * v["w2"]))) < 0.1  # a reused key would give identical tensors (mean 1)
    assert abs(float(jnp.mean(v["w1"]))) < 0.1
    again = hs.probe_like(jax.random.key(0), params)
    other = hs.probe_like(jax.random.key(1), params)
    assert bool(jnp.all(again["w1"] == v["w1"])) and not bool(jnp.all(other["w1"] == v["w1"]))
    g = np.asarray(hs.probe_like(jax.random.key(0), {"x": jnp.zeros((200, 200))}, "gaussian")["x"])
    assert abs(g.mean()) < 0.02 and abs(g.var() - 1) < 0.03 and abs((g**4).mean() - 3) < 0.15
    with pytest.raises(ValueError):
        hs.probe_like(jax.random.key(0), params, "uniform")


def test_hutchinson_matches_exact_trace_on_bert(bert_case, bert_hutchinson):
    _, _, _, H = bert_case
    est = bert_hutchinson
    tr, frob2 = np.trace(H), np.sum(H * H)
    assert abs(est.mean - tr) < 3 * est.stderr
    assert abs(est.trace_sq - frob2) < 3 * est.trace_sq_stderr
    # Rademacher variance: Var(v.Hv) = 2 (||H||_F^2 - sum_i H_ii^2).
    predicted = np.sqrt(2 * (frob2 - np.sum(np.diag(H) ** 2)))
    assert est.sample_std == pytest.approx(predicted, rel=0.1)
    assert est.stderr == pytest.approx(est.sample_std / np.sqrt(2000), rel=1e-6)
    assert sum(est.per_group.values()) == pytest.approx(est.mean, rel=1e-10)
    assert est.num_samples == 2000 and est.num_batches == 1 and est.data_std is None


def test_per_group_traces(bert_case, bert_hutchinson):
    """Top-level groups by name; the estimates' groups (here "block") each within 4 standard errors of the trace
    of their diagonal block of jax.hessian."""
    _, params, _, H = bert_case
    assert hs.param_groups(params)[0] == list(params) and hs.param_groups(params, "top")[0] == list(params)
    names, ids = hs.param_groups(params, "block")
    block_of = np.repeat(ids, [np.size(x) for x in jax.tree.leaves(params)])
    assert list(bert_hutchinson.per_group) == names
    for i, name in enumerate(names):  # 4 groups: allow 4 standard errors each
        exact = float(np.diag(H)[block_of == i].sum())
        assert abs(bert_hutchinson.per_group[name] - exact) < 4 * bert_hutchinson.per_group_stderr[name] + 1e-9


def test_exact_trace():
    with jax.enable_x64(True):
        params, batches = _toy_params(), _toy_batches(2)
        H, unravel = hs.exact_hessian(_toy_loss, params, batches)
        est = hs.exact_trace(_toy_loss, params, batches=batches, groups="leaf")
        assert est.mean == pytest.approx(float(jnp.trace(H)), rel=1e-12) and est.stderr == 0.0
        assert est.trace_sq == pytest.approx(float(jnp.sum(H * H)), rel=1e-12)
        assert set(est.per_group) == {"a", "b/c", "d"}
        assert est.per_group["b/c"] == pytest.approx(float(jnp.sum(unravel(jnp.diag(H))["b"]["c"])), rel=1e-12)
        for chunk in (1, 4, 64):  # chunks of Hessian columns (the last one partial) give the same numbers
            other = hs.exact_trace(_toy_loss, params, batches=batches, groups="leaf", chunk_size=chunk)
            assert other.mean == pytest.approx(est.mean, rel=1e-12)
            assert other.trace_sq == pytest.approx(est.trace_sq, rel=1e-12)
            assert other.per_group == pytest.approx(est.per_group, rel=1e-12)


def test_exact_trace_chunks_from_parameter_count_and_refuses_above_limit():
    """Issue 16: the exact trace of the tiny model asked XLA for 904 GB (jax.hessian makes all P columns at once).
    The chunk of columns now shrinks as P grows (~EXACT_CHUNK_BYTES of columns), and P > the limit is one line."""
    assert hs.exact_chunk_size(21) == 21
    assert hs.exact_chunk_size(475_000) == 35  # 35 columns x 475k x 16 bytes = 266 MB, not 475k columns
    assert hs.exact_chunk_size(475_000) * 475_000 * 16 <= hs.EXACT_CHUNK_BYTES
    assert hs.exact_chunk_size(10**8) == 1
    with pytest.raises(UserError, match=r"this model has 21 \(limit 20\); use --method hutchinson"):
        hs.exact_trace(_toy_loss, _toy_params(), batches=_toy_batches(1), max_params=20)


def test_hutchinson_streams_batches_and_splits_variance():
    with jax.enable_x64(True):
        params, batches = _toy_params(), _toy_batches(3)
        H, unravel = hs.exact_hessian(_toy_loss, params, batches)
        groups = lambda path: "ab" if path[0] in ("a", "b") else "d"
        est = hs.hutchinson_trace(_toy_loss, params, jax.random.key(0), 3000, batches=iter(batches),
                                  chunk_size=100, groups=groups)
        assert est.num_batches == 3 and est.num_samples == 9000 and set(est.per_group) == {"ab", "d"}
        assert abs(est.mean - float(jnp.trace(H))) < 3 * est.probe_stderr
        assert est.data_std is not None and est.data_std > 0 and est.stderr > est.probe_stderr
        assert sum(est.per_group.values()) == pytest.approx(est.mean, rel=1e-12)
        # Probes depend only on (key, batch, index): the chunking does not change the samples.
        one = hs.hutchinson_trace(_toy_loss, params, jax.random.key(0), 30, batches=batches[:1], chunk_size=1)
        many = hs.hutchinson_trace(_toy_loss, params, jax.random.key(0), 30, batches=batches[:1], chunk_size=7)
        assert one.mean == pytest.approx(many.mean, rel=1e-12)
        # Gaussian probes (the released code's): Var(v.Hv) = 2 ||H||_F^2, for a single-batch loss.
        H1, _ = hs.exact_hessian(_toy_loss, params, batches[:1])
        g = hs.hutchinson_trace(lambda p: _toy_loss(p, batches[0]), params, jax.random.key(1), 4000, kind="gaussian",
                                chunk_size=200)
        assert abs(g.mean - float(jnp.trace(H1))) < 3 * g.stderr
        assert g.sample_std == pytest.approx(float(jnp.sqrt(2 * jnp.sum(H1 * H1))), rel=0.1)


def test_hutchpp_on_psd_operator():
    with jax.enable_x64(True):
        params = _toy_params()
        rng = np.random.default_rng(2)
        U = rng.normal(size=(21, 4)) * np.array([30.0, 20.0, 10.0, 5.0])
        A = jnp.asarray(U @ U.T + np.diag(rng.uniform(0, 0.1, size=21)))  # dominant low rank + small full rank
        _, unravel = ravel_pytree(params)
        matvec = lambda p, v: unravel(A @ ravel_pytree(v)[0])
        est = hs.hutchpp_trace(matvec, params, jax.random.key(0), 30, chunk_size=4)
        plain = hs.hutchinson_trace(lambda p: 0.5 * ravel_pytree(p)[0] @ A @ ravel_pytree(p)[0], params,
                                    jax.random.key(0), 30)
        tr = float(jnp.trace(A))
        assert abs(est.mean - tr) < 3 * est.stderr + 1e-9
        assert est.stderr < 0.05 * plain.stderr
        assert sum(est.per_group.values()) == pytest.approx(est.mean, rel=1e-10)
        diag = unravel(jnp.diag(A))
        assert est.per_group["d"] == pytest.approx(float(jnp.sum(diag["d"])), abs=4 * est.per_group_stderr["d"] + 1e-9)
        batches = [{"scale": 1.0}, {"scale": 3.0}]  # streamed operator: mean over batches of scale * A
        est2 = hs.hutchpp_trace(lambda p, v, b: jax.tree.map(lambda x: b["scale"] * x, matvec(p, v)), params,
                                jax.random.key(0), 30, batches=batches)
        assert est2.mean == pytest.approx(2 * est.mean, rel=1e-6)


def test_trace_estimate_to_dict_is_json():
    est = TraceEstimate(mean=1.0, stderr=float("nan"), num_samples=3, per_group={"a": 1.0})
    d = json.loads(json.dumps(est.to_dict(), allow_nan=False))
    assert d["mean"] == 1.0 and d["stderr"] is None and d["per_group"] == {"a": 1.0}


MESH_SCRIPT = textwrap.dedent(
    """
    import json, sys
    sys.path.insert(0, "tests")
    import jax, jax.flatten_util, jax.numpy as jnp, numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    from flatness_tiny import fast_compile, float64_everywhere, mlm_batch, tiny_bert
    from flatlm.flatness import hessian as hs
    from flatlm.flatness.fisher import fisher_trace
    from flatlm.models.losses import mlm_loss

    assert jax.device_count() == 8
    f64 = float64_everywhere()  # keep a reference: the context lasts for the whole script
    f64.__enter__()
    model, params = tiny_bert()
    batch = mlm_batch(0, batch_size=8)
    loss = lambda p, b: mlm_loss(p, b, model.apply)
    mesh = Mesh(np.array(jax.devices()).reshape(4, 2), ("data", "model"))

    def spec(x):  # shard the first even axis on "model", like a tensor-parallel layout
        axes = [None] * x.ndim
        for i, n in enumerate(x.shape):
            if n % 2 == 0:
                axes[i] = "model"
                break
        return NamedSharding(mesh, P(*axes))

    shardings = jax.tree.map(spec, params)
    p_mesh = jax.device_put(params, shardings)
    b_mesh = jax.device_put(batch, NamedSharding(mesh, P("data")))
    assert len(p_mesh["layer_0"]["mlp"]["wi"].sharding.device_set) == 8
    key = jax.random.key(0)
    out = {}
    for name, p, b, s in [("one", params, batch, None), ("mesh", p_mesh, b_mesh, shardings)]:
        hv = jax.jit(lambda q, c: hs.hvp(lambda r: loss(r, c), q, hs.probe_like(key, q, shardings=s)))(p, b)
        est = hs.hutchinson_trace(loss, p, key, 64, batches=[b], chunk_size=8, shardings=s)
        fis = fisher_trace(model.apply, p, [b], key, num_draws=16, method="summed", draw_chunk_size=4)
        out[name] = {"hv": np.asarray(jax.flatten_util.ravel_pytree(hv)[0]).tolist(),
                     "est": est.to_dict(), "fisher": fis.to_dict()}
    print(json.dumps(out))
    """
)


@pytest.mark.slow  # ~40 s of CPU: a fresh process with 8 simulated devices compiles everything twice
def test_one_device_and_8_device_mesh_agree():
    env = dict(os.environ, XLA_FLAGS=xla_flags(8), JAX_PLATFORMS="cpu",
               JAX_DISABLE_MOST_OPTIMIZATIONS="1")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    res = subprocess.run([sys.executable, "-c", MESH_SCRIPT], cwd=root, env=env, capture_output=True, text=True,
                         timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    out = json.loads(res.stdout.strip().splitlines()[-1])
    one, mesh = out["one"], out["mesh"]
    np.testing.assert_allclose(mesh["hv"], one["hv"], rtol=1e-9, atol=1e-9)
    for key in ("est", "fisher"):
        a, b = one[key], mesh[key]
        assert b["mean"] == pytest.approx(a["mean"], rel=1e-9)
        assert b["stderr"] == pytest.approx(a["stderr"], rel=1e-6)
        for g in a["per_group"]:
            assert b["per_group"][g] == pytest.approx(a["per_group"][g], rel=1e-7, abs=1e-9)
    assert mesh["est"]["trace_sq"] == pytest.approx(one["est"]["trace_sq"], rel=1e-9)
    assert sum(one["est"]["per_group"].values()) == pytest.approx(one["est"]["mean"], rel=1e-10)


def test_block_groups_cover_bert_and_sum_to_the_total(bert_case, bert_hutchinson):
    """`groups="block"`: embeddings, each layer's attention and MLP, head. Exact per-block traces are the traces
    of jax.hessian's diagonal blocks and sum to Tr(H); Hutchinson's per-block estimates sum to its total (the same
    samples split), which is within its errors of Tr(H) (each block against its exact value: test_per_group_traces).
    """
    _, params, loss, H = bert_case
    two = jax.eval_shape(lambda: tiny_bert(num_layers=2, dtype="float32")[1])
    assert hs.param_groups(two, "block")[0] == ["head", "layer_0/attn", "layer_0/mlp", "layer_1/attn",
                                                "layer_1/mlp", "embed"]
    names, ids = hs.param_groups(params, "block")
    block_of = np.repeat(ids, [np.size(x) for x in jax.tree.leaves(params)])
    want = {n: float(np.diag(H)[block_of == i].sum()) for i, n in enumerate(names)}
    with float64_everywhere():
        exact = hs.exact_trace(loss, params, groups="block")
    assert exact.per_group == pytest.approx(want, rel=1e-10, abs=1e-12)
    assert sum(exact.per_group.values()) == pytest.approx(np.trace(H), rel=1e-12)
    est = bert_hutchinson
    assert sum(est.per_group.values()) == pytest.approx(est.mean, rel=1e-10)
    assert abs(sum(est.per_group.values()) - sum(want.values())) < 3 * est.stderr


def test_spectrum_report_against_eigh(bert_case):
    """`compare.spectrum_report` (what `flatlm flatness --spectrum-k/--density-probes` stores) on the MLM loss:
    every top Ritz value within its bound of an eigenvalue of jax.hessian's H, the largest converged to H's
    largest, and the SLQ moments Tr(H), Tr(H^2) within 4 standard errors of the exact ones."""
    model, params, _, H = bert_case
    eig = np.linalg.eigvalsh(H)
    with float64_everywhere():
        rep = compare.spectrum_report(model.apply, params, [mlm_batch(0)], jax.random.key(2), k=3,
                                      density_probes=8, density_iters=8)
    top = rep["top"]
    assert rep["dim"] == H.shape[0] and top["num_matvecs"] == 8 and len(top["values"]) == 3
    assert list(top["values"]) == sorted(top["values"], reverse=True)
    for v, r in zip(top["values"], top["residual"]):
        assert np.min(np.abs(eig - v)) <= r + 1e-9
    assert top["values"][0] == pytest.approx(eig[-1], rel=1e-6)
    moments = {m["p"]: m for m in rep["density"]["moments"]}
    assert sorted(moments) == [1, 2, 3, 4] and rep["density"]["num_matvecs"] == 64
    for p, exact in ((1, np.trace(H)), (2, np.sum(H * H))):
        assert abs(moments[p]["value"] - exact) < 4 * moments[p]["stderr"], (p, moments[p], exact)


@pytest.mark.slow  # ~5 s: compiles the stacked HVP of the tiny BERT in float64 (the estimator: test_trace_estimators)
def test_measure_xtrace_on_bert(bert_case):
    """`flatlm flatness --method xtrace`: XTrace of the MLM Hessian within 4 of its standard errors of Tr(H)."""
    model, params, _, H = bert_case
    with float64_everywhere():
        est = compare.measure("xtrace", model.apply, params, [mlm_batch(0)], jax.random.key(3), num_probes=200)
    assert est.method == "xtrace_sphere" and est.num_samples == 200
    assert abs(est.mean - np.trace(H)) < 4 * est.stderr, (est.mean, np.trace(H), est.stderr)


@pytest.mark.slow  # ~15 s: a fresh interpreter with 2 simulated devices (compile counts only; values as off the mesh)
def test_curvature_over_params_sharded_on_two_devices_compiles_each_program_once():
    """FSDP-like placement on 2 devices. Hutch++'s products met probe stacks in two layouts (fresh ones, and the
    orthonormal basis XLA laid out its own way), so the product program compiled twice; stacks are now placed as the
    params are (leading axis unsharded). Lanczos (top eigenvalues, preconditioned sharpness) compiled its step, the
    HVP and the preconditioner's product twice (a start vector, zeros or a product laid out unlike the next ones).
    Same values as off the mesh."""
    from conftest import run_python

    proc = run_python("""
        import json, logging, collections, numpy as np, jax, jax.numpy as jnp, flax.linen as nn
        from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
        from flatlm.data.masking import mask_batch
        from flatlm.flatness import spectrum
        from flatlm.flatness.compare import hessian_matvec, measure
        from flatlm.models import Bert, BertConfig
        compiled = collections.Counter()
        class Log(logging.Handler):
            def emit(self, r):
                m = r.getMessage()
                if m.startswith("Finished XLA compilation of"):
                    compiled[m.split()[4]] += 1
        jax.config.update("jax_log_compiles", True)
        logging.getLogger("jax").addHandler(Log())
        model = Bert(BertConfig(num_words=10, max_len=6, d_model=16, num_layers=1, num_heads=2, dropout=0.0,
                                attention_dropout=0.0))
        params = nn.unbox(model.init(jax.random.key(0), jnp.zeros((2, 6), jnp.int32))["params"])
        mesh = Mesh(np.array(jax.devices()).reshape(2, 1), ("data", "model"))
        split = lambda x: NamedSharding(mesh, P("data") if x.ndim and x.shape[0] % 2 == 0 else P())
        rng = np.random.default_rng(0)
        batches = [mask_batch(rng.integers(0, 10, (8, 6)), np.full(8, 6), 10, rng) for _ in range(2)]
        nu = jax.tree.map(lambda x: jnp.full(x.shape, 0.01, x.dtype), params)  # a stand-in for Adam's nu
        out = {}
        for name, p in (("single", params), ("sharded", jax.tree.map(lambda x: jax.device_put(x, split(x)), params))):
            compiled.clear()
            est = measure("hutchpp", model.apply, p, batches, jax.random.key(1), num_probes=12, chunk_size=2)
            out[name] = dict(mean=est.mean, hutchpp=dict(compiled))
            compiled.clear()
            mv = hessian_matvec(model.apply, p, batches)
            top = spectrum.top_eigenvalues(None, p, jax.random.key(2), k=2, num_iters=6, matvec=mv)
            pre = spectrum.preconditioned_sharpness(None, p, jax.tree.map(lambda x, s: jax.device_put(x, s.sharding),
                                                                          nu, p), jax.random.key(3), num_iters=6,
                                                    matvec=mv)
            out[name].update(top=float(top.values[0]), pre=float(pre.values[0]), lanczos=dict(compiled))
        print("RESULT" + json.dumps(out))
    """, devices=2)
    out = json.loads([x for x in proc.stdout.splitlines() if x.startswith("RESULT")][-1][len("RESULT"):])
    hutchpp, lanczos = out["sharded"]["hutchpp"], out["sharded"]["lanczos"]
    assert hutchpp["jit(apply_batch)"] == 1 and hutchpp["jit(per_sample_dots)"] == 1, hutchpp
    # one Lanczos step program (both runs keep a basis of 6 rows), one HVP, one leafwise product
    assert lanczos["jit(_lanczos_step)"] == 1 and lanczos["jit(mlm_hvp)"] == 1, lanczos
    assert lanczos["jit(_multiply_trees)"] == 1, lanczos
    assert lanczos["jit(ravel)"] == 1, lanczos  # the products come back laid out as the params, as the start vector
    for key in ("mean", "top", "pre"):
        assert out["sharded"][key] == pytest.approx(out["single"][key], rel=1e-4), out
