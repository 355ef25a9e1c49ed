"""Evaluators of a checkpoint: exact pre-training loss, linear probe, fine-tuning, lookup-table baseline.

Each takes arrays plus (apply_fn, params), apply_fn being the model's Flax `apply` (the exact loss still takes
the module), and returns a JSON-able results dict.
  exact_loss.py  entropy + KL of the model's conditionals against the language's exact ones
  features.py    frozen features: every token's hidden state concatenated, optional Gaussian projection
  cache.py       the on-disk feature cache (per checkpoint step, split and projection)
  heads.py       what probe and fine-tuning share: masked cross-entropy, schedule, minibatches, summaries
  probe.py       linear probe on frozen concatenated features (seeds vmapped)
  finetune.py    full fine-tuning with a head on the CLS position
  lookup.py      the same probe on the language's exact conditionals (a perfect-loss model)
Import from the submodules (`from flatlm.evaluate.probe import run_probe`); nothing is re-exported here, so
`flatlm.evaluate.finetune` stays the module.
"""
