"""MLM pre-training on the OPT language: sentences of T tokens from OPT restricted to its K most frequent tokens.

Presets: `tiny` (a small random OPT, so CI exercises the whole path on CPU), `cpu` (a larger random OPT, not yet
measured for convergence), `paper` (OPT-125M from a local
Hugging Face directory, K=2000, T=24; downstream GLUE QNLI and SST-2 from local TSV files).
Usage: flatlm train --config configs/opt_mlm.py:paper --workdir /tmp/run \\
           --config.language.checkpoint=/path/to/opt-125m [--config.eval.downstream.glue_dir=/path/to/glue]

language fields (see flatlm.languages.opt):
  checkpoint        local HF OPT directory (config.json + safetensors or .bin); nothing is downloaded
  opt_shape         with no checkpoint: random weights of this OPTConfig.named shape ("" = a checkpoint is required)
  init_std          std of those random weights (0.3 gives a random language with sharp conditionals)
  vocab_size        K, the number of words (OPT tokens kept); length: T, words per sentence
  freq_file         .npy of token counts over OPT's vocabulary ranking the K tokens; "" = the model's own unigram
                    estimate from `unigram_contexts` sampled contexts (the paper does not say which it used)
eval.downstream fields (see flatlm.data.glue): tasks, glue_dir (holds SST-2/, QNLI/), tokenizer (a local HF
  tokenizer directory; "" = the checkpoint's), oov_word (-1 drops out-of-vocabulary tokens, else the word used
  for them), source ("tfds": tfds's glue builder; "tsv": the same files read directly).
"""

import ml_collections

from flatlm.config import base_config, presets


def get_config(arg: str = "tiny"):
    c = base_config()
    c.language.name = "opt"
    preset = presets(
        {
            "tiny": dict(checkpoint="", shape="tiny", std=0.3, words=8, length=6, contexts=16, train=2_000,
                         eval=50, batch=64, d=64, layers=1, steps=60, lr=3e-3, eval_every=30, ckpt=30),
            # cpu: a random tiny teacher with 12 words, sentences of 8; NOT yet measured against the "same loss"
            # band (configs/experiments/README.md lists the HMM as the cpu language); OPT downstream = GLUE files
            "cpu": dict(checkpoint="", shape="tiny", std=0.3, words=12, length=8, contexts=64, train=50_000,
                        eval=200, batch=64, d=64, layers=1, steps=2000, lr=3e-3, eval_every=200, ckpt=2000),
            # The paper (A.1) generates 2 x 10^8 sentences: streamed (data.source=stream), not stored. Exact
            # conditionals cost ~K*T^2/2 OPT token-forwards per sentence, so the evaluation set is 2,000 sentences,
            # not the 10^6 of the PCFG/HMM runs (A.6 gives no OPT size; 10^6 would be ~5 x 10^11 token-forwards).
            "paper": dict(checkpoint="", shape="", std=0.02, words=2000, length=24, contexts=1024,
                          train=200_000_000, eval=2_000, batch=4096, d=768, layers=12, steps=30_000, lr=1e-3,
                          eval_every=1000, ckpt=1000),
        },
        arg, __file__,
    )
    c.language.update(vocab_size=preset["words"], length=preset["length"])
    c.language.checkpoint = preset["checkpoint"]
    c.language.opt_shape = preset["shape"]
    c.language.init_std = preset["std"]
    c.language.freq_file = ""
    c.language.unigram_contexts = preset["contexts"]
    c.data.update(train_size=preset["train"], eval_size=preset["eval"], batch_size=preset["batch"])
    c.model.update(d_model=preset["d"], num_layers=preset["layers"])
    c.train.update(steps=preset["steps"], lr=preset["lr"], eval_every=preset["eval_every"],
                   log_every=min(50, preset["eval_every"]))
    c.checkpoint.every = preset["ckpt"]
    c.eval.downstream = ml_collections.ConfigDict(
        dict(tasks=("sst2", "qnli"), glue_dir="", tokenizer="", oov_word=-1, source="tfds"))
    if arg == "paper":
        c.train.warmup_frac = 0.06
        c.data.source = "stream"
        c.eval.finetune.epochs = 10  # A.5: 10 epochs, 200 warmup steps (the base config's)
        c.eval.loss_average = "sentence"
        c.eval.batch_size = 512
    return c
