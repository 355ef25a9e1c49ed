"""The Hugging Face peer of `train_step.py`: BertForMaskedLM + torch.optim.AdamW at a library shape, at its best
(fused tanh GELU, the fastest of eager / torch.compile and of the gradient-accumulation slices, timed in the
caller's rounds). Needs the `bench`
extra (torch, transformers); `hf_available` says why not when they are missing."""

from __future__ import annotations

import time

import numpy as np
from _util import optional_modules


def hf_available() -> str | None:
    """None if torch + transformers import, else why not."""
    return optional_modules("torch", "transformers")[1]


def _hf_model(cfg, dropout: bool, seq_len: int):
    import torch  # reason: optional peer
    import transformers  # reason: optional peer

    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    hc = transformers.BertConfig(
        vocab_size=cfg.vocab_size, hidden_size=cfg.d_model, num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.heads, intermediate_size=cfg.ff, max_position_embeddings=seq_len,
        # gelu_pytorch_tanh: the fused kernel of tanh GELU (gelu_new is the same maths in several ops)
        hidden_act="gelu_pytorch_tanh" if cfg.gelu_approximate else "gelu",
        hidden_dropout_prob=cfg.dropout if dropout else 0.0,
        attention_probs_dropout_prob=cfg.attention_dropout if dropout else 0.0, layer_norm_eps=cfg.ln_eps)
    return transformers.BertForMaskedLM(hc).train()


def hf_cases(cfg, train, batch: dict, threads: int, modes: list[str], ks: list[int]) -> tuple[dict, dict]:
    """({"hf:MODE k=K": call, "hf_nodrop:MODE k=K": call, ...}, info): one BertForMaskedLM (post-LN) +
    torch.optim.AdamW step at the same shape, with dropout as the JAX step ("hf") and without ("hf_nodrop"), in
    every one of `modes` (eager, compile: torch.compile of the model) x `ks` (gradient accumulation over k slices
    of the batch, each loss weighted by its share of the labelled tokens: the same update) that runs; each called
    once (warm-up, compile). The caller times them all in its rounds and takes each side's fastest (`_util.best_of`).
    info: each variant's first call in s, or why it failed."""
    import torch  # reason: optional peer

    torch.set_num_threads(threads)
    torch._dynamo.reset()  # a fresh compile cache per shape: the earlier shapes' graphs would count against its
    # recompile limit (8 per function), past which torch.compile runs the model eagerly (one warning in the log)
    ids = torch.from_numpy(np.array(batch["tokens"], np.int64))
    labels = torch.from_numpy(np.where(batch["weights"] > 0, batch["targets"], -100).astype(np.int64))
    calls, info = {}, {}
    for name, dropout in (("hf", True), ("hf_nodrop", False)):
        for mode, k in [(m, k) for m in modes for k in ks]:
            model = _hf_model(cfg, dropout, ids.shape[1])
            opt = torch.optim.AdamW(model.parameters(), lr=train.lr, betas=(train.b1, train.b2), eps=train.eps,
                                    weight_decay=train.weight_decay)
            run = torch.compile(model) if mode == "compile" else model
            parts = [slice(m * len(ids) // k, (m + 1) * len(ids) // k) for m in range(k)]
            shares = [float((labels[p] != -100).sum() / (labels != -100).sum()) for p in parts]

            def call(run=run, opt=opt, parts=parts, shares=shares):
                for part, share in zip(parts, shares, strict=True):
                    loss = run(input_ids=ids[part], labels=labels[part]).loss
                    (loss if len(parts) == 1 else loss * share).backward()
                opt.step()
                opt.zero_grad(set_to_none=True)

            try:
                t0 = time.perf_counter()
                call()
                info[f"{name}_{mode}_k{k}_first_s"] = time.perf_counter() - t0
            except Exception as e:  # noqa: BLE001 - e.g. no C++ compiler for torch.compile: keep the other mode
                info[f"{name}_{mode}_k{k}"] = f"failed: {type(e).__name__}: {str(e)[:120]}"
                continue
            calls[f"{name}:{mode} k={k}"] = call
        if not any(n.startswith(f"{name}:") for n in calls):
            raise RuntimeError(f"no HF mode ran: {info}")
    info["hf_params"] = sum(p.numel() for p in model.parameters())
    return calls, info

