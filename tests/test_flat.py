"""flatlm.flatness.flat: raveled parameter vectors and stacks, split over a mesh's devices (padded to a multiple of
their count), against the unsplit computation and numpy."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.flatten_util import ravel_pytree

from flatlm.flatness import flat


def _params():
    return {"a": jnp.arange(21.0).reshape(7, 3), "b": jnp.arange(5, dtype=jnp.bfloat16)}


def test_off_a_mesh_ravel_is_ravel_pytree_and_unravel_gives_the_tree_back():
    params = _params()
    sp = flat.space(params)
    assert (sp.n, sp.size, sp.mesh, sp.sharding(), jnp.dtype(sp.dtype)) == (26, 26, None, None, jnp.float32)
    ravel, unravel = flat.ravellers(sp)
    x = ravel(params)
    np.testing.assert_array_equal(x, ravel_pytree(jax.tree.map(lambda t: t.astype(jnp.float32), params))[0])
    back = unravel(x)
    assert back["b"].dtype == jnp.bfloat16
    jax.tree.map(np.testing.assert_array_equal, back, params)


def test_draws_are_jax_random_draws_and_qr_is_numpy_qr_off_a_mesh():
    sp = flat.space(_params())
    key = jax.random.key(3)
    np.testing.assert_array_equal(flat.draw(key, sp, 4), jax.random.rademacher(key, (4, 26), jnp.float32))
    np.testing.assert_array_equal(flat.draw(key, sp, 4, "normal"), jax.random.normal(key, (4, 26), jnp.float32))
    Y = np.random.default_rng(0).normal(size=(5, 26)).astype(np.float32)
    Q, R = flat.qr_rows(jnp.asarray(Y), sp)
    Q0, R0 = np.linalg.qr(Y.T.astype(np.float64))
    np.testing.assert_allclose(np.abs(np.asarray(R)), np.abs(R0), rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(np.abs(np.asarray(Q)), np.abs(Q0.T), rtol=1e-4, atol=1e-5)


def test_stacks_and_the_lanczos_basis_are_split_over_eight_devices_with_the_values_of_one():
    """A quadratic loss 0.5 x^T H x over 26 parameters (a [7, 3] and a [5] leaf, replicated as data-parallel keeps
    them) on a 2 x 4 mesh: vectors are padded to 32 and each device holds 4 columns of every stack and of Lanczos's
    basis (before: the whole of each, replicated). Hutchinson, Hutch++, XTrace and the Lanczos top eigenvalues equal
    the unsplit run's (one process, same keys); TSQR's factors match numpy's; H's top eigenvalues are exact. The
    streamed Hutch++'s pytree stacks (`flatlm.sharding.stacked_spec`) are split by the axes a parameter leaves
    unused (before: as the parameter, so replicated ones whole on every device), with the unsplit estimate."""
    from conftest import run_python

    proc = run_python("""
        import json, numpy as np, jax, jax.numpy as jnp
        from jax.flatten_util import ravel_pytree
        from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
        from flatlm.flatness import flat, spectrum, trace_estimators as te
        rng = np.random.default_rng(0)
        U = np.linalg.qr(rng.normal(size=(26, 26)))[0]
        eig = np.logspace(2, -2, 26)
        H = jnp.asarray((U * eig) @ U.T, jnp.float32)
        loss = lambda p: 0.5 * ravel_pytree(p)[0] @ H @ ravel_pytree(p)[0]
        params = {"a": jnp.ones((7, 3)), "b": jnp.ones(5)}
        mesh = Mesh(np.array(jax.devices()).reshape(2, 4), ("data", "model"))
        on_mesh = jax.device_put(params, NamedSharding(mesh, P()))
        shards = {}
        step = spectrum._lanczos_step
        def spy(B, *a, **k):
            shards["basis"] = [list(B.shape), list(B.addressable_shards[0].data.shape)]
            return step(B, *a, **k)
        spectrum._lanczos_step = spy
        out = {}
        for name, p in (("one", params), ("mesh", on_mesh)):
            key = jax.random.key(1)
            out[name] = dict(
                hutchinson=te.hutchinson(loss, p, key, 6).mean, hutchpp=te.hutchpp(loss, p, key, 12).mean,
                xtrace=te.xtrace(loss, p, key, 16).mean,
                xtrace_signs=te.xtrace(loss, p, key, 16, kind="rademacher").mean,
                top=spectrum.top_eigenvalues(loss, p, jax.random.key(2), k=3, num_iters=26).values.tolist())
        mm, sp = te.operator(loss, on_mesh)
        Y = mm(flat.draw(jax.random.key(4), sp, 5))
        shards["stack"] = [list(Y.shape), list(Y.addressable_shards[0].data.shape)]
        Q, R = flat.qr_rows(Y, sp)
        shards["q"] = [list(Q.shape), list(Q.addressable_shards[0].data.shape)]
        Yn = np.asarray(Y, np.float64)
        R0 = np.linalg.qr(Yn.T)[1]
        qr = dict(orth=float(np.abs(np.asarray(Q) @ np.asarray(Q).T - np.eye(5)).max()),
                  recon=float(np.abs(np.asarray(R).T @ np.asarray(Q) - Yn).max() / np.abs(Yn).max()),
                  r=float(np.abs(np.abs(np.diag(np.asarray(R))) / np.abs(np.diag(R0)) - 1).max()),
                  pad=float(np.abs(np.asarray(Q)[:, 26:]).max()))
        # Hutch++'s streamed stacks [K, *shape]: the mesh axes a parameter leaves unused split the copies too
        from flatlm import sharding
        from flatlm.flatness import hessian
        p2 = {"w": jnp.ones((16, 8)), "t": jnp.ones((16, 8)), "b": jnp.ones(3)}
        specs = {"w": P(), "t": P(None, "model"), "b": P()}
        p2_mesh = {k: jax.device_put(v, NamedSharding(mesh, specs[k])) for k, v in p2.items()}
        stack = sharding.place_like(p2_mesh, jax.tree.map(lambda x: jnp.zeros((4, *x.shape)), p2), stacked=True)
        shards["hutchpp"] = {k: list(v.addressable_shards[0].data.shape) for k, v in stack.items()}
        U2 = np.linalg.qr(rng.normal(size=(259, 259)))[0]
        H2 = jnp.asarray((U2 * np.logspace(2, -2, 259)) @ U2.T, jnp.float32)
        mv = lambda p, v: hessian.hvp(lambda q: 0.5 * ravel_pytree(q)[0] @ H2 @ ravel_pytree(q)[0], p, v)
        for name, p in (("one", p2), ("mesh", p2_mesh)):
            out[name]["streamed_hutchpp"] = hessian.hutchpp_trace(mv, p, jax.random.key(5), 30).mean
        print("RESULT" + json.dumps(dict(out=out, shards=shards, qr=qr, size=sp.size, eig=eig[:3].tolist())))
    """, devices=8)
    res = json.loads([x for x in proc.stdout.splitlines() if x.startswith("RESULT")][-1][len("RESULT"):])
    assert res["size"] == 32
    assert res["shards"] == {"basis": [[26, 32], [26, 4]], "stack": [[5, 32], [5, 4]], "q": [[5, 32], [5, 4]],
                             # replicated [16, 8]: split 8-way on its rows; tp's [16, 8] over model: rows over data
                             "hutchpp": {"w": [4, 2, 8], "t": [4, 8, 2], "b": [4, 3]}}
    one, mesh = res["out"]["one"], res["out"]["mesh"]
    for name in ("hutchinson", "hutchpp", "xtrace", "xtrace_signs", "streamed_hutchpp"):
        assert mesh[name] == pytest.approx(one[name], rel=1e-5), (name, one, mesh)
    np.testing.assert_allclose(mesh["top"], one["top"], rtol=1e-5)
    np.testing.assert_allclose(mesh["top"], res["eig"], rtol=1e-4)
    assert res["qr"]["orth"] < 1e-5 and res["qr"]["recon"] < 1e-5 and res["qr"]["r"] < 1e-4, res["qr"]
    assert res["qr"]["pad"] == 0.0
