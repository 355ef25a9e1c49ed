"""MLM pre-training on a sparse contextual bigram language (SCB, issue 19; `flatlm.languages.scb`).

language fields: vocab_size N (words), context_length T (sentences have T + 1 words), sparsity (positions each
last word's attention pattern Q_k puts mass on), concentration (Dirichlet parameter of each column of the transition
P), seed (`flatlm.languages.scb.random_scb(seed, ...)`). Downstream: task "position", the context position s the
last word was drawn from (T classes).
Presets: `tiny` (CPU, seconds; the KL barely moves), `cpu` (2 shared CPU cores, about 2 minutes; BERT masking and no
dropout: with single-position masking and dropout 3000 steps stayed at the marginal-only model's KL; not converged,
see configs/experiments/README.md "SCB").
Usage: flatlm train --config configs/scb_mlm.py:tiny --workdir /tmp/run
"""

from flatlm.config import base_config, presets


def get_config(arg: str = "tiny"):
    c = base_config()
    c.language.name = "scb"
    preset = presets(
        {
            "tiny": dict(words=8, context=6, sparsity=2, alpha=0.5, train=2_000, eval=200, batch=64,
                         d=64, layers=1, steps=60, lr=3e-3, eval_every=30, ckpt=30),
            "cpu": dict(words=16, context=10, sparsity=2, alpha=0.5, train=50_000, eval=500, batch=64,
                        d=64, layers=2, steps=4000, lr=1e-3, eval_every=1000, ckpt=2000),
        },
        arg, __file__,
    )
    c.language.vocab_size = preset["words"]
    c.language.context_length = preset["context"]
    c.language.sparsity = preset["sparsity"]
    c.language.concentration = preset["alpha"]
    c.data.update(train_size=preset["train"], eval_size=preset["eval"], batch_size=preset["batch"])
    c.model.update(d_model=preset["d"], num_layers=preset["layers"])
    c.train.update(steps=preset["steps"], lr=preset["lr"], eval_every=preset["eval_every"],
                   log_every=min(50, preset["eval_every"]))
    c.checkpoint.every = preset["ckpt"]
    if arg == "cpu":  # up to 5 masked positions per sentence: the last word (the one with context) is masked more
        c.data.masking = "bert"
        c.model.update(dropout=0.0, attention_dropout=0.0)
    c.eval.tasks = ("position",)
    c.eval.update(task_train_size=preset["train"] // 4, task_eval_size=preset["eval"])
    c.eval.probe.update(epochs=10 if arg == "tiny" else 50, num_seeds=2 if arg == "tiny" else 3)
    c.eval.finetune.update(epochs=10 if arg == "tiny" else 3, num_seeds=2 if arg == "tiny" else 3, warmup_steps=20,
                           lr=1e-3)
    return c
