"""Evaluators of a checkpoint: exact pre-training loss, linear probe, fine-tuning, lookup-table baseline.

Each takes arrays plus (model or feature function, params) and returns a JSON-able results dict.
  exact_loss.py  entropy + KL of the model's conditionals against the language's exact ones
  probe.py       linear probe on frozen concatenated features (seeds vmapped), feature extraction and cache
  finetune.py    full fine-tuning with a head on the CLS position
  lookup.py      the same probe on the language's exact conditionals (a perfect-loss model)
Import from the submodules (`from flatlm.evaluate.probe import run_probe`); nothing is re-exported here, so
`flatlm.evaluate.finetune` stays the module.
"""
