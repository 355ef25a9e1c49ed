"""The OPT language: an OPT decoder (the teacher) restricted to K words, with exact log-probabilities and conditionals.

  model.py     OPTConfig, the Flax OPT decoder with a KV cache, random parameters
  hf.py        local Hugging Face checkpoints (safetensors or torch .bin) -> OPTConfig and parameters
  language.py  OPTLanguage (sampling, log_prob, exact MLM conditionals), top-k vocabulary, `from_spec`
"""

from flatlm.languages.opt.hf import convert_hf_state, load_hf_checkpoint, read_hf_state
from flatlm.languages.opt.language import (
    DEFAULT_K,
    DEFAULT_LENGTH,
    OPTLanguage,
    from_spec,
    model_unigram,
    top_k_token_ids,
)
from flatlm.languages.opt.model import (
    OPT,
    KVCache,
    OPTConfig,
    append_cache,
    init_cache,
    init_params,
    num_params,
    random_params,
)

__all__ = [
    "DEFAULT_K", "DEFAULT_LENGTH", "OPT", "KVCache", "OPTConfig", "OPTLanguage", "append_cache", "convert_hf_state",
    "from_spec", "init_cache", "init_params", "load_hf_checkpoint", "model_unigram", "num_params", "random_params",
    "read_hf_state", "top_k_token_ids",
]
