"""MLM pre-training on the paper's PCFG language (released grammar shape: 50 nonterminals, 200 words, depth <= 6).

The default grammar is `random_grammar(language.seed)`, a fresh grammar with the released file's shape and
statistics. To use the authors' grammar file: --config.language.rules_file=path/to/pcfg_rule_deep_mlm.txt.
Presets: `tiny` (CPU, a minute), `demo` (CPU, minutes), `paper` (the paper's scale).
Downstream tasks A, B, C use the released definition by default (--config.eval.task_definition=posterior).
"""

from flatlm.config import base_config, presets


def get_config(arg: str = "tiny"):
    c = base_config()
    c.language.name = "pcfg"
    p = presets(
        {
            "tiny": dict(train=4_000, eval=128, batch=64, d=64, layers=1, steps=60, lr=3e-3, every=30,
                         task_train=1_000, task_eval=200, probe_epochs=10, ft_epochs=10, seeds=2),
            "demo": dict(train=20_000, eval=256, batch=128, d=128, layers=2, steps=1200, lr=2e-3, every=200,
                         task_train=4_000, task_eval=1_000, probe_epochs=20, ft_epochs=2, seeds=3),
            "paper": dict(train=4_000_000, eval=10_000, batch=4096, d=768, layers=12, steps=30_000, lr=1e-3,
                          every=1000, task_train=100_000, task_eval=10_000, probe_epochs=100, ft_epochs=50,
                          seeds=5),
        },
        arg, __file__,
    )
    c.data.update(train_size=p["train"], eval_size=p["eval"], batch_size=p["batch"])
    c.model.update(d_model=p["d"], num_layers=p["layers"])
    c.train.update(steps=p["steps"], lr=p["lr"], eval_every=p["every"], log_every=min(50, p["every"]))
    c.checkpoint.every = p["every"]
    c.eval.update(task_train_size=p["task_train"], task_eval_size=p["task_eval"])
    c.eval.probe.update(epochs=p["probe_epochs"], num_seeds=p["seeds"])
    c.eval.finetune.update(epochs=p["ft_epochs"], num_seeds=p["seeds"])
    if arg != "paper":
        c.eval.finetune.warmup_steps = 20
    if arg == "tiny":  # a thousand sentences: 10 epochs at 1e-3 so that fine-tuning moves at all
        c.eval.finetune.lr = 1e-3
    return c
