"""The Hugging Face peer of `train_step.py`: BertForMaskedLM + torch.optim.AdamW at a library shape, at its best
(fused tanh GELU, the fastest of eager / torch.compile and of the gradient-accumulation slices). Needs the `bench`
extra (torch, transformers); `hf_available` says why not when they are missing."""

from __future__ import annotations

import time

import numpy as np
from _util import optional_modules, time_once


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
    """({"hf": call, "hf_nodrop": call}, info): one BertForMaskedLM (post-LN) + torch.optim.AdamW step at the
    same shape, with dropout as the JAX step and without, each in the fastest of `modes` (eager, compile:
    torch.compile of the model) x `ks` (gradient accumulation over k slices of the batch, each loss weighted by
    its share of the labelled tokens: the same update), chosen by the median of 3 calls after warm-up; info has
    every variant's time."""
    import torch  # reason: optional peer

    torch.set_num_threads(threads)
    ids = torch.from_numpy(np.array(batch["tokens"], np.int64))
    labels = torch.from_numpy(np.where(batch["weights"] > 0, batch["targets"], -100).astype(np.int64))
    calls, info = {}, {}
    for name, dropout in (("hf", True), ("hf_nodrop", False)):
        best = None
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
                first = time.perf_counter() - t0
            except Exception as e:  # noqa: BLE001 - e.g. no C++ compiler for torch.compile: keep the other mode
                info[f"{name}_{mode}_k{k}"] = f"failed: {type(e).__name__}: {str(e)[:120]}"
                continue
            sec = float(np.median([time_once(call)[0] for _ in range(3)]))
            info[f"{name}_{mode}_k{k}_ms"], info[f"{name}_{mode}_k{k}_first_s"] = sec * 1e3, first
            if best is None or sec < best[0]:
                best = (sec, f"{mode} k={k}", call)
        if best is None:
            raise RuntimeError(f"no HF mode ran: {info}")
        calls[name], info[f"{name}_mode"] = best[2], best[1]
    info["hf_params"] = sum(p.numel() for p in model.parameters())
    return calls, info
