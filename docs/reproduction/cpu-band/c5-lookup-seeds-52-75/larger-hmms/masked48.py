"""masked_ceiling.measure on the scan's 48 / 40 / 4 / length-10 HMM, task k5 (exploratory, session 19)."""
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import masked_ceiling as mc  # noqa: E402

from flatlm.config import apply_overrides, load_config  # noqa: E402

OVR = ["--config.language.num_states=48", "--config.language.vocab_size=40", "--config.language.num_blocks=4",
       "--config.language.length=10"]
mc.load_config = lambda spec: apply_overrides(load_config(spec), OVR)
print(json.dumps({**mc.measure("configs/hmm_mlm.py:cpu", 5), "overrides": OVR}), flush=True)
