"""Accelerator benchmarks (issue 17's GPU goals): MLM step MFU at L12-H768 bf16, PCFG and HMM conditionals.

    python benchmarks/gpu.py [--out results.json] [--small] [--batches 512,4096] [--no-hf] [--hf-modes eager,compile]
                             [--no-mlm] [--conditionals pcfg-released,pcfg-dense,hmm] [--microbatches 4,8]
                             [--pcfg-chunks 1024,4096,16384] [--dense-chunks 128,512,2048]

Rows, all measured in one run on the first JAX device:
- matmul peaks: an 8192^3 bf16 and float32 jitted matmul (the ceilings MFU is read against, next to the
  vendor's dense bf16 figure when the device is known);
- the library's MLM train step (`flatlm.train.step.train_step`, AdamW, real `Bert`) at L12-H768 (BERT-base,
  Table 3), sequence length 32, bf16 compute with float32 parameters, dropout on and off, and with
  `--microbatches` the largest batch's step in that many slices (gradient accumulation: same update, less
  memory); each row with XLA's temporaries; MFU = model FLOPs (3 x forward: 24 L D^2 + 4 L T D per token, the head
  at the predicted positions; `bert_train_flops`) / step time / peak;
- when torch + transformers import and CUDA is there: Hugging Face BertForMaskedLM at the same shape at its
  best (bf16 autocast, SDPA, fused tanh GELU, fused AdamW; eager and torch.compile, the faster kept), in a
  child process with the GPU's memory to itself;
- exact conditionals (`_gpu_conditionals.py`): the released-shape PCFG (`random_grammar(0)`), a dense N=50
  PCFG at T=32, and the paper's HMM (K=100, V=200, T=16), each end to end through the public API (host arrays
  out); the PCFG rows at each of `--pcfg-chunks` / `--dense-chunks` (inference chunk sizes; one that runs out of
  memory is an error row), the released-shape one in each of `--layouts`; the released-shape PCFG and the HMM
  with each of `--transfers` ($FLATLM_HOST_TRANSFER: outputs to the host through pageable or pinned memory,
  `flatlm.languages.base.start_host_copy`), the HMM at the library's default chunk, at 1024, 65536 and in one
  call of all its sentences, and in the dataset builder's calls of 1024; the raw device-to-host bandwidth of its
  839 MB chunk of conditionals either way, and its kernel alone on device-resident data.

Step times are medians of `--rounds` rounds of `--steps` back-to-back steps (dispatch pipelined, one sync per
round). `--out` is rewritten after every section, so a run cut off by a time limit keeps what it measured. Never
part of the tests (CI has no accelerator; tests/test_architecture.py only compiles it). Results for a device go in
benchmarks/RESULTS.md.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import subprocess
import sys
import tempfile
import time
import traceback

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from _gpu_conditionals import hmm_rows, median_time, pcfg_dense_row, pcfg_released_row

from flatlm import compile_options, paths
from flatlm.config import base_config
from flatlm.data.masking import mask_batch
from flatlm.languages.base import HOST_TRANSFERS
from flatlm.models import Bert, model_config
from flatlm.train import optim
from flatlm.train.step import train_step

NUM_WORDS, SEQ_LEN = 200, 32
HEAD_POSITIONS = 5  # predicted positions per sentence at most (`mask_batch`'s bert default): head FLOPs count there
VENDOR_BF16_TFLOPS = {"H100": 989.0, "H200": 989.0, "A100": 312.0}  # dense, no sparsity (datasheets)


def matmul_tflops(n: int, dtype) -> float:
    """TFLOP/s of one jitted n^3 matmul on random data (median of 10 rounds of 5)."""
    k1, k2 = jax.random.split(jax.random.key(0))
    a, b = jax.random.normal(k1, (n, n), dtype), jax.random.normal(k2, (n, n), dtype)
    f = jax.jit(jnp.matmul)
    holder = {}

    def call(sync):
        holder["y"] = f(a, b)
        if sync:
            holder["y"].block_until_ready()

    return 2 * n**3 / median_time(call, 10, 5) / 1e12


def bert_train_flops(d: int, layers: int, ff: int, seq: int, vocab: int, tokens: int,
                     head_tokens: int) -> float:
    """Model FLOPs of one train step (forward + backward = 3 x forward), matmuls only: per token and layer
    qkv 6D^2, out 2D^2, MLP 4 D ff, attention scores + values 4 T D; the head's dense 2D^2 and output 2 D V at
    the `head_tokens` positions MLM predicts (flatlm's head runs there only, HF's at every token: both rows count
    the predicted ones, so MFU ratios are speed ratios)."""
    per_token = layers * (8 * d * d + 4 * d * ff + 4 * seq * d)
    return 3.0 * (per_token * tokens + (2 * d * d + 2 * d * vocab) * head_tokens)


def flatlm_step(shape: str, batch_size: int, dtype: str, dropout: bool, rounds: int, steps: int,
                microbatches: int = 1) -> dict:
    """Median step time, MFU and XLA's temporaries of the library's jitted, donated MLM train step (with
    `microbatches` > 1: gradient accumulation over that many slices, `train.microbatches`)."""
    c = base_config()
    c.model.shape, c.model.dtype = shape, dtype
    cfg = model_config(c.model, NUM_WORDS, SEQ_LEN)
    model, optimizer = Bert(cfg), optim.optimizer(c.train)
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, NUM_WORDS, (batch_size, SEQ_LEN))
    batch = jax.device_put(mask_batch(tokens, np.full(batch_size, SEQ_LEN), NUM_WORDS, rng, masking="bert"))
    params = nn.unbox(jax.jit(model.init)(jax.random.key(0), jnp.zeros((2, SEQ_LEN), jnp.int32))["params"])
    state = {"step": jnp.zeros((), jnp.int32), "params": params, "opt_state": optimizer.init(params)}
    fn = jax.jit(functools.partial(train_step, apply_fn=model.apply, optimizer=optimizer, seed=0, dropout=dropout,
                                   microbatches=microbatches), donate_argnums=0)
    t0 = time.perf_counter()
    compiled = fn.lower(state, batch).compile()
    compile_s = time.perf_counter() - t0
    holder = {"s": state}

    def call(sync):
        holder["s"], metrics = compiled(holder["s"], batch)
        if sync:
            jax.block_until_ready(metrics)

    sec = median_time(call, rounds, steps)
    n_params = sum(x.size for x in jax.tree.leaves(params))
    flops = bert_train_flops(cfg.d_model, cfg.num_layers, cfg.ff, SEQ_LEN, NUM_WORDS, batch_size * SEQ_LEN,
                             batch["positions"].size)
    return dict(shape=shape, batch=batch_size, dtype=dtype, dropout=dropout, microbatches=microbatches,
                params=n_params, step_s=sec, tokens_per_s=batch_size * SEQ_LEN / sec, model_tflops=flops / sec / 1e12,
                compile_s=compile_s, temp_gib=compiled.memory_analysis().temp_size_in_bytes / 2**30)


def hf_step(shape_dl: tuple[int, int], batch_size: int, rounds: int, steps: int, modes: list[str]) -> dict:
    """Hugging Face BertForMaskedLM at its best on CUDA: bf16 autocast, SDPA, gelu_pytorch_tanh, fused AdamW;
    eager, and torch.compile when asked (the faster is kept and named)."""
    import torch  # optional peer: only on machines with torch  # reason: optional dependency
    import transformers  # reason: optional dependency

    transformers.logging.set_verbosity_error()
    layers, d = shape_dl
    hf_cfg = transformers.BertConfig(vocab_size=NUM_WORDS + 3, hidden_size=d, num_hidden_layers=layers,
                                     num_attention_heads=d // 64, intermediate_size=4 * d,
                                     max_position_embeddings=SEQ_LEN, hidden_act="gelu_pytorch_tanh",
                                     attn_implementation="sdpa")
    rng = np.random.default_rng(0)
    tokens = torch.tensor(rng.integers(0, NUM_WORDS, (batch_size, SEQ_LEN)), device="cuda")
    labels = torch.where(torch.rand(tokens.shape, device="cuda") < 0.15, tokens, -100)
    results = {}
    for mode in modes:
        model = transformers.BertForMaskedLM(hf_cfg).cuda().train()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)

        def step(model=model, opt=opt):
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = model(input_ids=tokens, labels=labels).loss
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            return loss

        run = torch.compile(step) if mode == "compile" else step
        for _ in range(3):
            run()
        torch.cuda.synchronize()

        def call(sync, run=run):
            run()
            if sync:
                torch.cuda.synchronize()

        results[mode] = median_time(call, rounds, steps)
    best = min(results, key=results.get)
    sec = results[best]
    flops = bert_train_flops(d, layers, 4 * d, SEQ_LEN, NUM_WORDS + 3, batch_size * SEQ_LEN,
                             batch_size * HEAD_POSITIONS)
    return dict(batch=batch_size, best=best, step_s=sec, all_s=results, tokens_per_s=batch_size * SEQ_LEN / sec,
                model_tflops=flops / sec / 1e12, torch=torch.__version__, transformers=transformers.__version__)


def hf_in_child(batch_size: int, rounds: int, steps: int, modes: list[str]) -> dict:
    """`hf_step` at L12-H768 in a child process: this process's JAX holds most of the GPU's memory (its pool is
    not given back), and next to it torch ran out of memory at batch 4096 (2026-11-23 and 2026-11-27, H100)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "hf.json")
        cmd = [sys.executable, os.path.abspath(__file__), "--hf-only", "--out", out, "--hf-batch", str(batch_size),
               "--hf-modes", ",".join(modes), "--rounds", str(rounds), "--steps", str(steps),
               "--seq-len", str(SEQ_LEN), "--num-words", str(NUM_WORDS)]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode:
            raise RuntimeError(f"HF child exited {proc.returncode}: {proc.stderr.strip()[-2000:]}")
        with open(out) as f:
            return json.load(f)


def guarded(name: str, fn, out: dict, save=None):
    """Run one section into out[name]; a failure is recorded (and printed), not fatal to the others. `save()`
    runs after it (a run cut off by its time limit keeps what it measured)."""
    try:
        out[name] = fn()
    except Exception as e:  # noqa: BLE001 - one failing section must not lose the others' numbers
        traceback.print_exc()
        out[name] = {"error": f"{type(e).__name__}: {e}"}
    if save:
        save()


def write_json(obj, path: str | None) -> None:
    """obj as JSON at `path` (no-op without one), written whole or not at all (`flatlm.paths.write_text`)."""
    if path:
        paths.write_text(path, json.dumps(obj, indent=1))


def main(argv=None) -> int:
    """Run every section, write the JSON, print a summary table; returns 0."""
    global NUM_WORDS, SEQ_LEN  # noqa: PLW0603 - the shape every section uses
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default=None, help="write all results here as JSON")
    p.add_argument("--small", action="store_true", help="tiny sizes: check the script on a CPU")
    p.add_argument("--no-hf", action="store_true", help="skip the Hugging Face peer")
    p.add_argument("--seq-len", type=int, default=SEQ_LEN, help="MLM sequence length (default 32)")
    p.add_argument("--num-words", type=int, default=NUM_WORDS, help="MLM vocabulary (default 200)")
    p.add_argument("--hf-modes", default="eager,compile", help="HF variants to time (the faster is kept)")
    p.add_argument("--batches", default=None, help="MLM batches, comma-separated (default 512,4096; --small: 8)")
    p.add_argument("--hf-batch", type=int, default=None, help="HF peer batch (default: the last of --batches)")
    p.add_argument("--no-f32", action="store_true", help="skip the float32 step")
    p.add_argument("--conditionals", default="pcfg,hmm",
                   help="which conditionals rows: pcfg (= pcfg-released,pcfg-dense), hmm; '' for none")
    p.add_argument("--no-mlm", action="store_true", help="skip the matmul peaks and every MLM step row")
    p.add_argument("--rounds", type=int, default=None, help="timed rounds per MLM row (default 5; --small: 2)")
    p.add_argument("--steps", type=int, default=None, help="steps per round (default 10; --small: 2)")
    p.add_argument("--pcfg-chunks", default="", help="released-shape PCFG chunk sizes to sweep, e.g. "
                   "1024,4096,16384 (default 4096; --small 256)")
    p.add_argument("--dense-chunks", default="", help="dense PCFG chunk sizes to sweep (default 512)")
    p.add_argument("--microbatches", default="", help="also time the last batch's dropout step split into these "
                   "slice counts, comma-separated (train.microbatches: gradient accumulation), e.g. 4,8")
    p.add_argument("--transfers", default="pageable,pinned", help="host transfers of the released PCFG and HMM "
                   "rows ($FLATLM_HOST_TRANSFER values), comma-separated")
    p.add_argument("--layouts", default="", help="released-shape PCFG chart layouts, comma-separated (default "
                   "symbol_minor,batch_minor; --small: batch_minor)")
    p.add_argument("--hf-only", action="store_true", help=argparse.SUPPRESS)  # hf_in_child's entry point
    args = p.parse_args(argv)
    sizes = lambda text: [int(x) for x in text.split(",") if x] or None  # noqa: E731
    transfers = tuple(x for x in args.transfers.split(",") if x)
    if bad := [x for x in transfers if x not in HOST_TRANSFERS]:  # checked before minutes of device time, not after
        p.error(f"--transfers: unknown {', '.join(bad)}; choose from {', '.join(HOST_TRANSFERS)}")
    layouts = tuple(x for x in args.layouts.split(",") if x)
    if bad := [x for x in layouts if x not in ("symbol_minor", "batch_minor")]:
        p.error(f"--layouts: unknown {', '.join(bad)}; choose from symbol_minor, batch_minor")
    rows = {"pcfg-released": functools.partial(pcfg_released_row, chunks=sizes(args.pcfg_chunks), transfers=transfers,
                                               layouts=layouts),
            "pcfg-dense": functools.partial(pcfg_dense_row, chunks=sizes(args.dense_chunks)),
            "hmm": functools.partial(hmm_rows, transfers=transfers)}
    which = [w for w in args.conditionals.split(",") if w]
    which = [x for w in which for x in (["pcfg-released", "pcfg-dense"] if w == "pcfg" else [w])]
    if unknown := [w for w in which if w not in rows]:
        p.error(f"--conditionals: unknown row(s) {', '.join(unknown)}; choose from pcfg, {', '.join(rows)}")
    NUM_WORDS, SEQ_LEN = args.num_words, args.seq_len
    rounds, steps = args.rounds or (2 if args.small else 5), args.steps or (2 if args.small else 10)
    if args.hf_only:  # the child: torch alone on the GPU, JAX never initialised
        write_json(hf_step((12, 768), args.hf_batch, rounds, steps, args.hf_modes.split(",")), args.out)
        return 0
    dev = jax.devices()[0]
    res = {"device": dev.device_kind, "platform": dev.platform, "jax": jax.__version__,
           "xla_flags": os.environ.get("XLA_FLAGS", ""), "chart_options": {"CHART (wide blocks)": compile_options.CHART,
                             "CHART_SMALL_DOTS (the others)": compile_options.CHART_SMALL_DOTS}}
    if dev.platform == "cpu" and not args.small:
        print("benchmarks/gpu.py: no accelerator, skipped (results on one: benchmarks/RESULTS.md; "
              "--small checks the script on a CPU)")
        return 0
    print(f"device: {dev.device_kind} ({dev.platform}), jax {jax.__version__}", flush=True)
    save = functools.partial(write_json, res, args.out)
    n = 512 if args.small else 8192
    shape = "L1-H64" if args.small else "L12-H768"
    if not args.no_mlm:
        guarded("matmul_bf16_tflops", lambda: matmul_tflops(n, jnp.bfloat16), res, save)
        guarded("matmul_f32_tflops", lambda: matmul_tflops(n, jnp.float32), res, save)
        batches = [int(b) for b in (args.batches or ("8" if args.small else "512,4096")).split(",")]
        cases = [(b, "bfloat16", True, 1) for b in batches] + [(batches[-1], "bfloat16", False, 1)]
        cases += [] if args.no_f32 else [(batches[0], "float32", True, 1)]
        cases += [(batches[-1], "bfloat16", True, int(k)) for k in args.microbatches.split(",") if k]
        for batch, dtype, dropout, k in cases:
            guarded(f"flatlm {shape} B{batch} {dtype} dropout={dropout}" + (f" microbatches={k}" if k > 1 else ""),
                    functools.partial(flatlm_step, shape, batch, dtype, dropout, rounds, steps, k), res, save)
        if not args.no_hf and dev.platform == "gpu":
            hb = args.hf_batch or batches[-1]
            guarded(f"hf {shape} B{hb} bf16 autocast",
                    lambda: hf_in_child(hb, rounds, steps, args.hf_modes.split(",")), res, save)
    res["conditionals"] = cond = {}
    for w in which:  # each section's rows (hmm: two) under their own names; a failure under the section's name
        guarded(w, functools.partial(rows[w], args.small), cond, save)
        if "error" not in cond[w]:
            cond.update(cond.pop(w))
    save()
    vendor = next((v for k, v in VENDOR_BF16_TFLOPS.items() if k in dev.device_kind), None)
    peak = res.get("matmul_bf16_tflops")
    print(f"\nbf16 matmul {n}^3: {peak if isinstance(peak, float) else peak} TFLOP/s measured; "
          f"vendor dense bf16: {vendor or 'unknown'}")
    for k, v in res.items():
        if k.startswith(("flatlm", "hf")) and "error" not in v:
            mfu = v["model_tflops"] / peak if isinstance(peak, float) else float("nan")
            mfu_v = v["model_tflops"] / vendor if vendor else float("nan")
            temp = f"  temp {v['temp_gib']:.2f} GiB" if "temp_gib" in v else ""
            print(f"{k:42s} {v['step_s'] * 1e3:8.2f} ms/step {v['tokens_per_s']:12,.0f} tok/s "
                  f"{v['model_tflops']:7.1f} TFLOP/s  MFU {100 * mfu:5.1f}% of measured, {100 * mfu_v:5.1f}% of vendor"
                  + temp)
    for k, v in (res.get("conditionals") or {}).items():
        if isinstance(v, dict) and "sentences_per_s" in v:
            rate = f"  {v['gb_per_s']:.2f} GB/s" if "gb_per_s" in v else f"  (compile {v['compile_s']:.1f} s)"
            print(f"{k:60s} {v['sentences_per_s']:14,.0f} sent/s" + rate)
    errors = [k for k, v in res.items() if isinstance(v, dict) and "error" in v]
    if errors:
        print("FAILED sections:", ", ".join(errors))
    return 0


if __name__ == "__main__":
    sys.exit(main())
