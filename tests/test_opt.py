"""OPT decoder, HF checkpoint converter, KV cache, and the restricted-OPT language (exact log_prob/conditionals)."""

from __future__ import annotations

import dataclasses
import importlib.util
import itertools
import json
import sys

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import scipy.stats

from flatlm.errors import UserError
from flatlm.languages.opt import (
    OPT,
    OPTConfig,
    OPTLanguage,
    append_cache,
    init_cache,
    load_hf_checkpoint,
    model_unigram,
    num_params,
    random_params,
    top_k_token_ids,
)

HAS_HF = all(importlib.util.find_spec(m) is not None for m in ("torch", "transformers"))
PRE_LN = OPTConfig.named("tiny")
POST_LN_PROJ = OPTConfig.named("tiny", word_embed_proj_dim=16, do_layer_norm_before=False)  # the 350M layout
WORDS = [5, 9, 17, 33, 40]  # OPT ids of the 5-word restriction


@pytest.mark.skipif(not HAS_HF, reason="needs torch and transformers (pip install 'flatlm[hf]')")
@pytest.mark.parametrize("layout,fmt", [("pre_ln", "safetensors"), ("post_ln_proj", "bin")])
def test_logits_match_hugging_face(tmp_path, layout, fmt):
    """Flax logits == HF OPTForCausalLM logits through the converter, for safetensors and PyTorch .bin files."""
    import torch
    import transformers

    cfg = PRE_LN if layout == "pre_ln" else POST_LN_PROJ
    torch.manual_seed(0)
    hf = transformers.OPTForCausalLM(transformers.OPTConfig(**cfg.to_hf(), init_std=0.3)).eval()
    with torch.no_grad():  # non-trivial biases and LayerNorm parameters too
        for p in hf.parameters():
            p.add_(0.1 * torch.randn_like(p))
    if fmt == "safetensors":
        hf.save_pretrained(tmp_path)
        assert (tmp_path / "model.safetensors").exists()
    else:  # the hub's OPT .bin files hold an OPTModel state dict ("decoder.*", no "model." prefix, no lm_head)
        hf.config.save_pretrained(tmp_path)
        torch.save(hf.model.state_dict(), tmp_path / "pytorch_model.bin")
    loaded_cfg, params = load_hf_checkpoint(str(tmp_path))
    assert loaded_cfg == cfg
    ids = np.random.default_rng(0).integers(0, cfg.vocab_size, (3, 11))
    with torch.no_grad():
        ref = hf(torch.tensor(ids)).logits.numpy()
    ours = np.asarray(jax.jit(OPT(cfg).apply)({"params": params}, jnp.asarray(ids)))
    assert np.abs(ref).max() > 1.0  # logits that discriminate
    np.testing.assert_allclose(ours, ref, atol=1e-5, rtol=0)


def test_bin_checkpoint_without_torch_is_a_clear_error(tmp_path, monkeypatch):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "opt", **PRE_LN.to_hf()}))
    (tmp_path / "pytorch_model.bin").write_bytes(b"")
    monkeypatch.setitem(sys.modules, "torch", None)  # import torch -> ImportError
    with pytest.raises(UserError, match="needs torch"):
        load_hf_checkpoint(str(tmp_path))
    with pytest.raises(UserError, match="no config.json"):
        load_hf_checkpoint(str(tmp_path / "missing"))


def test_named_shapes_have_the_released_parameter_counts():
    counts = {"125m": 125_239_296, "350m": 331_196_416}  # HF OPTModel parameter counts
    for name, count in counts.items():
        cfg = OPTConfig.named(name)
        shapes = jax.eval_shape(lambda cfg=cfg: OPT(cfg).init(jax.random.PRNGKey(0), jnp.zeros((1, 1), jnp.int32)))
        assert num_params(nn.unbox(shapes["params"])) == count
    assert OPTConfig.named("350m").has_projection and not OPTConfig.named("350m").has_final_ln


def test_kv_cached_decoding_equals_full_forward():
    """Incremental decoding into a fixed buffer, and one prefix shared by a batch, equal the full forward.
    (Post-LN with projections here; the pre-LN cache path is exercised by the conditionals below.)"""
    cfg = POST_LN_PROJ
    params = random_params(cfg, seed=1, std=0.3)
    model = OPT(cfg)
    tokens = jnp.asarray(np.random.default_rng(1).integers(0, cfg.vocab_size, (2, 7)))
    forward = jax.jit(lambda toks: model.apply({"params": params}, toks))
    decode = jax.jit(lambda toks, cache=None: model.apply({"params": params}, toks, cache=cache, method=OPT.decode))
    full = forward(tokens)
    # a 3-token prompt, then one token at a time into a fixed 7-slot buffer
    append = jax.jit(append_cache)
    cache = init_cache(cfg, 2, 7)
    logits, kv = decode(tokens[:, :3], cache)
    steps = [logits]
    cache = append(cache, kv)
    for t in range(3, 7):
        logits, kv = decode(tokens[:, t: t + 1], cache)
        cache = append(cache, kv)
        steps.append(logits)
    np.testing.assert_allclose(np.concatenate(steps, 1), full, atol=1e-5, rtol=0)
    # one cached prefix (batch 1) shared by 3 different continuations
    _, kv = decode(tokens[:1, :4])
    prefix = append(init_cache(cfg, 1, 6), kv)
    conts = jnp.asarray(np.random.default_rng(2).integers(0, cfg.vocab_size, (3, 2)))
    logits, _ = decode(conts, prefix)
    ref = forward(jnp.concatenate([jnp.repeat(tokens[:1, :4], 3, 0), conts], 1))
    np.testing.assert_allclose(logits, ref[:, 4:], atol=1e-5, rtol=0)


@pytest.fixture(scope="module")
def tiny_language():
    """5-word restriction of a sharp random tiny OPT, sentences of 4 words."""
    return OPTLanguage(PRE_LN, random_params(PRE_LN, seed=0, std=0.15), WORDS, length=4, candidate_chunk=2,
                       batch_size=1024)


def test_log_prob_and_conditionals_equal_brute_force(tiny_language):
    lang, K, T = tiny_language, 5, 4
    everything = np.array(list(itertools.product(range(K), repeat=T)), np.int32)
    lengths = np.array([4, 3, 2])  # lengths < T: the marginal of the first l words
    x = np.where(np.arange(T) < lengths[:, None], everything[[7, 300, 611]], lang.specials.pad)
    logp = lang.log_prob(np.concatenate([everything, x]), np.concatenate([np.full(len(everything), T), lengths]))
    assert abs(np.exp(logp[:-3]).sum() - 1) < 1e-5
    P = np.exp(logp[:-3]).reshape((K,) * T)
    marg = [P, P.sum(3), P.sum((2, 3))]
    np.testing.assert_allclose(logp[-3:], [np.log(marg[T - l][tuple(x[b, :l])]) for b, l in enumerate(lengths)],
                               atol=1e-5)
    q = lang.conditionals(x, lengths)
    assert q.shape == (3, T, K)
    for b, l in enumerate(lengths):
        for t in range(T):
            if t >= l:
                assert not q[b, t].any()
                continue
            idx = list(x[b, :l])
            idx[t] = slice(None)
            ref = marg[T - l][tuple(idx)]
            np.testing.assert_allclose(q[b, t], ref / ref.sum(), atol=1e-5)
    assert q[0].max() > 0.5  # the model is sharp enough for the comparison to mean something
    lang.prefix_cache = False  # the baseline without the cache (same compiled sentence pass)
    try:
        np.testing.assert_allclose(lang.conditionals(x, lengths), q, atol=1e-5)
    finally:
        lang.prefix_cache = True


def test_sampling_frequencies_match_log_prob():
    lang = OPTLanguage(PRE_LN, random_params(PRE_LN, seed=0, std=0.15), WORDS, length=3, batch_size=20_000)
    n, K = 20_000, 5
    corpus = lang.sample(n, seed=0)
    assert corpus.tokens.shape == (n, 3) and corpus.tokens.dtype == np.int32 and (corpus.lengths == 3).all()
    np.testing.assert_array_equal(corpus.latents["opt_ids"], np.asarray(WORDS)[corpus.tokens])
    everything = np.array(list(itertools.product(range(K), repeat=3)), np.int32)
    expected = n * np.exp(lang.log_prob(everything, np.full(len(everything), 3)))
    observed = np.bincount(np.ravel_multi_index(corpus.tokens.T, (K,) * 3), minlength=K**3)
    big = expected >= 5  # pool the rare strings into one cell
    obs = np.append(observed[big], observed[~big].sum())
    exp = np.append(expected[big], expected[~big].sum())
    assert scipy.stats.chisquare(obs, exp * obs.sum() / exp.sum()).pvalue > 1e-3
    np.testing.assert_array_equal(lang.sample(100, seed=0).tokens, corpus.tokens[:100])  # deterministic in seed


def test_vocabulary_restriction_choices():
    freq = np.arange(64.0)[::-1].copy()  # id 0 most frequent, but 0..3 are OPT's special tokens
    np.testing.assert_array_equal(top_k_token_ids(freq, 3), [4, 5, 6])
    np.testing.assert_array_equal(top_k_token_ids(np.ones(10), 2, exclude=()), [0, 1])  # ties: smaller id first
    with pytest.raises(UserError):
        top_k_token_ids(freq, 61)
    params = random_params(PRE_LN, seed=0, std=0.15)
    unigram = model_unigram(PRE_LN, params, num_contexts=8, context_length=4, batch_size=8)
    assert unigram.shape == (64,) and abs(unigram.sum() - 1) < 1e-5
    lang = OPTLanguage.from_model(PRE_LN, params, k=6, length=4, unigram_contexts=8)
    np.testing.assert_array_equal(lang.token_ids, top_k_token_ids(model_unigram(PRE_LN, params, 8, 4), 6))
    assert lang.vocab_size == 6 and lang.max_length == 4 and lang.specials.pad == 6
    with pytest.raises(UserError):
        lang.log_prob(np.full((1, 4), 6), np.array([4]))  # the pad id is not a word


def test_saved_checkpoint_loads_back_bit_exactly(tmp_path):
    """`save_hf_checkpoint` writes HF names and layouts that `load_hf_checkpoint` (tested against transformers in
    test_logits_match_hugging_face) reads back to the same tree, with and without biases."""
    from flatlm.languages.opt.hf import load_hf_checkpoint, save_hf_checkpoint
    from flatlm.languages.opt.model import OPTConfig, random_params

    for cfg in (OPTConfig.named("tiny"), dataclasses.replace(OPTConfig.named("tiny"), enable_bias=False)):
        params = random_params(cfg, seed=3, std=0.3)
        save_hf_checkpoint(str(tmp_path / str(cfg.enable_bias)), cfg, params)
        cfg2, params2 = load_hf_checkpoint(str(tmp_path / str(cfg.enable_bias)))
        assert cfg2 == cfg
        jax.tree.map(np.testing.assert_array_equal, jax.tree.map(np.asarray, params), params2)
