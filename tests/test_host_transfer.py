"""$FLATLM_HOST_TRANSFER: kernels' outputs reach numpy through pageable (the CPU's default) or pinned (an
accelerator's) host memory with the same bits, chunked or not, for the HMM and the PCFG engine (one worker and
several); a bad value is one line."""

from __future__ import annotations

import types

import jax
import numpy as np
import pytest
from conftest import REPO, run_cli

from flatlm.errors import UserError
from flatlm.languages.base import HOST_TRANSFER_ENV, host_transfer, start_host_copy
from flatlm.languages.hmm import random_hmm
from flatlm.languages.pcfg import random_grammar


class _Device:  # what `host_transfer` reads of a device: its platform and its memories' kinds
    def __init__(self, platform, kinds=("device", "pinned_host", "unpinned_host")):
        self.platform, self.kinds = platform, kinds

    def addressable_memories(self):
        return [types.SimpleNamespace(kind=k) for k in self.kinds]


def test_the_default_is_pinned_on_accelerators_with_pinned_memory_else_pageable(monkeypatch):
    monkeypatch.delenv(HOST_TRANSFER_ENV, raising=False)
    devices = [_Device("cpu"), _Device("gpu"), _Device("tpu"), _Device("metal", ("device",))]
    assert [host_transfer(d) for d in devices] == ["pageable", "pinned", "pinned", "pageable"]
    assert host_transfer() == host_transfer(jax.devices()[0]) == "pageable"  # these tests' CPU backend
    for how in ("pageable", "pinned"):  # the variable wins everywhere
        monkeypatch.setenv(HOST_TRANSFER_ENV, how)
        assert [host_transfer(d) for d in devices[:2]] == [how, how]


def test_start_host_copy_puts_the_values_where_asked(monkeypatch):
    x = jax.numpy.arange(12.0).reshape(3, 4)
    monkeypatch.delenv(HOST_TRANSFER_ENV, raising=False)
    assert host_transfer() == "pageable"
    assert start_host_copy(x).sharding.memory_kind == x.sharding.memory_kind
    monkeypatch.setenv(HOST_TRANSFER_ENV, "pinned")
    y = start_host_copy(x)
    assert y.sharding.memory_kind == "pinned_host" and x.sharding.memory_kind != "pinned_host"
    a = np.asarray(y)
    np.testing.assert_array_equal(a, np.arange(12.0).reshape(3, 4))
    assert a.ctypes.data == y.unsafe_buffer_pointer()  # read in place: no second copy


@pytest.mark.parametrize("chunk_size", [1024, 32])  # one call (returned as it is), 4 calls into one array
def test_hmm_conditionals_are_the_same_bits_either_way(monkeypatch, chunk_size):
    hmm = random_hmm(0, length=6)
    corpus = hmm.sample(100, seed=1)
    out = {}
    for how in ("pageable", "pinned"):
        monkeypatch.setenv(HOST_TRANSFER_ENV, how)
        out[how] = (hmm.conditionals(corpus.tokens, corpus.lengths, chunk_size=chunk_size),
                    hmm.state_posteriors(corpus.tokens, corpus.lengths, chunk_size=chunk_size))
    for a, b in zip(out["pageable"], out["pinned"], strict=True):
        assert a.shape[0] == 100
        np.testing.assert_array_equal(a, b)
    np.testing.assert_allclose(out["pinned"][0].sum(-1)[corpus.lengths[:, None] > np.arange(6)], 1.0, atol=1e-5)


def test_pcfg_outputs_are_the_same_bits_either_way_with_one_worker_and_several(monkeypatch):
    g = random_grammar(1, num_roots=3, levels=3, symbols_per_level=3, num_words=8, rules_per_symbol=4,
                       leaf_rules=4, batch_size=4)  # bucketed charts of several sizes, 8 chunks
    corpus = g.sample(30, seed=21)
    out = {}
    for how in ("pageable", "pinned"):
        monkeypatch.setenv(HOST_TRANSFER_ENV, how)
        for workers in (1, 2):  # 1: the accelerators' path (dispatch ahead of the read), 2: threads
            g._engine.workers = workers
            out[how, workers] = (g.conditionals(corpus.tokens, corpus.lengths),
                                 g.span_posteriors(corpus.tokens, corpus.lengths))
    for key, value in out.items():
        for a, b in zip(out["pageable", 1], value, strict=True):
            np.testing.assert_array_equal(a, b, err_msg=str(key))


def test_an_unknown_transfer_is_a_one_line_error(monkeypatch, tmp_path):
    monkeypatch.setenv(HOST_TRANSFER_ENV, "dma")
    with pytest.raises(UserError, match="FLATLM_HOST_TRANSFER='dma' is not one of pageable, pinned"):
        host_transfer()
    run = run_cli("data", "--config", str(REPO / "configs" / "hmm_mlm.py") + ":tiny", "--data-dir",
                  str(tmp_path / "d"), "--quiet", env={HOST_TRANSFER_ENV: "dma"})
    assert run.returncode == 2, run.stderr[-2000:]
    assert "Traceback" not in run.stderr and "FLATLM_HOST_TRANSFER='dma'" in run.stderr
    assert len(run.stderr.strip().splitlines()) == 1
