"""Hugging Face OPT checkpoints -> the teacher's parameter tree (`flatlm.languages.opt.model.OPT`).

Reads a local checkpoint directory (config.json plus model.safetensors or pytorch_model.bin, sharded or not) and
renames/reshapes HF's `OPTForCausalLM` / `OPTModel` tensors to this package's layout; never downloads. Safetensors
are parsed directly (no torch); a .bin needs torch, imported only then.
"""

from __future__ import annotations

import json
import os

import jax
import ml_dtypes  # a JAX dependency: numpy has no bfloat16
import numpy as np

from flatlm.errors import UserError
from flatlm.languages.opt.model import OPTConfig

_SAFETENSORS_DTYPES = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16", "I64": "int64",
                       "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8", "BOOL": "bool"}


def read_safetensors(path: str) -> dict[str, np.ndarray]:
    """Tensors of a .safetensors file as numpy arrays (bf16 via ml_dtypes, which numpy lacks).

    The format is an 8-byte little-endian header size, a JSON header {name: {dtype, shape, data_offsets}}, then the
    raw bytes; read directly so neither torch nor bf16 support in `safetensors.numpy` is needed.
    """
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(n))
        data = f.read()
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        dtype = _SAFETENSORS_DTYPES.get(info["dtype"])
        if dtype is None:
            raise UserError(f"{path}: tensor {name} has unsupported dtype {info['dtype']}")
        np_dtype = ml_dtypes.bfloat16 if dtype == "bfloat16" else np.dtype(dtype)
        lo, hi = info["data_offsets"]
        out[name] = np.frombuffer(data[lo:hi], dtype=np_dtype).reshape(info["shape"]).copy()
    return out


def _read_torch_bin(path: str) -> dict[str, np.ndarray]:
    try:
        import torch  # optional extra (flatlm[hf]): only .bin checkpoints need it
    except ImportError as e:
        raise UserError(f"{path} is a PyTorch checkpoint and reading it needs torch (pip install 'flatlm[hf]'); "
                        "or save the checkpoint as safetensors, which flatlm reads without torch") from e
    state = torch.load(path, map_location="cpu", weights_only=True)
    return {k: v.detach().float().numpy() if v.is_floating_point() else v.numpy() for k, v in state.items()}


def read_hf_state(path: str) -> dict[str, np.ndarray]:
    """All tensors of a local HF checkpoint directory: model.safetensors (preferred) or pytorch_model.bin, sharded
    (`*.index.json`) or not."""
    for single, index, reader in [("model.safetensors", "model.safetensors.index.json", read_safetensors),
                                  ("pytorch_model.bin", "pytorch_model.bin.index.json", _read_torch_bin)]:
        if os.path.exists(os.path.join(path, single)):
            return reader(os.path.join(path, single))
        if os.path.exists(os.path.join(path, index)):
            with open(os.path.join(path, index)) as f:
                files = sorted(set(json.load(f)["weight_map"].values()))
            state = {}
            for name in files:
                state.update(reader(os.path.join(path, name)))
            return state
    raise UserError(f"no model.safetensors or pytorch_model.bin (or sharded index) in {path}")


def convert_hf_state(state: dict[str, np.ndarray], cfg: OPTConfig) -> dict:
    """Map HF `OPTForCausalLM` / `OPTModel` tensor names onto this module's parameter tree (float32 numpy)."""
    pdt = np.dtype(cfg.param_dtype)
    sd = {}
    for k, v in state.items():
        for prefix in ("model.", ""):
            if k.startswith(prefix + "decoder."):
                sd[k[len(prefix + "decoder."):]] = np.asarray(v, np.float32)
        if k == "lm_head.weight":
            sd["lm_head"] = np.asarray(v, np.float32)
    used = set()

    def get(name):
        if name not in sd:
            raise UserError(f"checkpoint lacks decoder.{name}")
        used.add(name)
        return sd[name]

    H, Dh, D = cfg.num_heads, cfg.head_dim, cfg.hidden_size
    ln = lambda name: {"norm": {"scale": get(f"{name}.weight"), "bias": get(f"{name}.bias")}}
    params = {"embed_tokens": get("embed_tokens.weight"), "embed_positions": get("embed_positions.weight")}
    if cfg.has_projection:
        params["project_in"] = get("project_in.weight").T  # torch Linear stores [out, in]
        params["project_out"] = get("project_out.weight").T
    if cfg.has_final_ln:
        params["final_ln"] = ln("final_layer_norm")
    for i in range(cfg.num_layers):
        p = f"layers.{i}."
        qkv = np.stack([get(p + f"self_attn.{n}_proj.weight").T.reshape(D, H, Dh) for n in "qkv"], axis=1)
        attn = {"qkv": qkv, "out": get(p + "self_attn.out_proj.weight").T.reshape(H, Dh, D)}
        mlp = {"wi": get(p + "fc1.weight").T, "wo": get(p + "fc2.weight").T}
        if cfg.enable_bias:
            attn["qkv_bias"] = np.stack([get(p + f"self_attn.{n}_proj.bias").reshape(H, Dh) for n in "qkv"])
            attn["out_bias"] = get(p + "self_attn.out_proj.bias")
            mlp["bi"], mlp["bo"] = get(p + "fc1.bias"), get(p + "fc2.bias")
        params[f"layer_{i}"] = {"attn_ln": ln(p + "self_attn_layer_norm"), "attn": attn,
                                "mlp_ln": ln(p + "final_layer_norm"), "mlp": mlp}
    if "lm_head" in sd and not np.array_equal(sd["lm_head"], params["embed_tokens"]):
        raise UserError("checkpoint's lm_head differs from embed_tokens; flatlm's OPT ties them")
    extra = set(sd) - used - {"lm_head"}
    if extra:
        raise UserError(f"unexpected tensors in checkpoint: {', '.join(sorted(extra)[:5])}")
    return jax.tree.map(lambda x: np.ascontiguousarray(x, pdt), params)


def load_hf_checkpoint(path: str) -> tuple[OPTConfig, dict]:
    """(OPTConfig, params) from a local HF OPT directory (config.json + safetensors or .bin); never downloads."""
    cfg_path = os.path.join(path, "config.json")
    if not os.path.exists(cfg_path):
        raise UserError(f"{path} is not a Hugging Face checkpoint directory (no config.json)")
    with open(cfg_path) as f:
        cfg = OPTConfig.from_hf(json.load(f))
    return cfg, convert_hf_state(read_hf_state(path), cfg)


def write_safetensors(path: str, tensors: dict[str, np.ndarray]) -> None:
    """Write float32/int tensors in the safetensors format `read_safetensors` reads (atomically: temp + rename)."""
    names = {np.dtype(v): k for k, v in _SAFETENSORS_DTYPES.items() if v != "bfloat16"}
    header, offset, blobs = {}, 0, []
    for name, x in tensors.items():
        x = np.ascontiguousarray(x)
        header[name] = {"dtype": names[x.dtype], "shape": list(x.shape), "data_offsets": [offset, offset + x.nbytes]}
        blobs.append(x.tobytes())
        offset += x.nbytes
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)  # the format pads the header to 8 bytes
    tmp = f"{path}.tmp"
    with open(tmp, "wb") as f:
        f.write(len(raw).to_bytes(8, "little") + raw + b"".join(blobs))
    os.replace(tmp, path)


def save_hf_checkpoint(path: str, cfg: OPTConfig, params) -> None:
    """A local HF OPT directory (config.json + model.safetensors, `OPTForCausalLM` names) holding `params`:
    the inverse of `convert_hf_state`, so a teacher built in flatlm (e.g. `random_params`) can be read back by
    `load_hf_checkpoint` or by transformers. Tests use it to make small local checkpoints without a hub."""
    p = jax.tree.map(lambda x: np.asarray(x, np.float32), params)
    H, Dh, D = cfg.num_heads, cfg.head_dim, cfg.hidden_size
    sd = {"embed_tokens.weight": p["embed_tokens"], "embed_positions.weight": p["embed_positions"]}
    if cfg.has_projection:
        sd["project_in.weight"], sd["project_out.weight"] = p["project_in"].T, p["project_out"].T
    if cfg.has_final_ln:
        sd["final_layer_norm.weight"] = p["final_ln"]["norm"]["scale"]
        sd["final_layer_norm.bias"] = p["final_ln"]["norm"]["bias"]
    for i in range(cfg.num_layers):
        layer, pre = p[f"layer_{i}"], f"layers.{i}."
        attn, mlp = layer["attn"], layer["mlp"]
        for j, n in enumerate("qkv"):
            sd[pre + f"self_attn.{n}_proj.weight"] = attn["qkv"][:, j].reshape(D, H * Dh).T
        sd[pre + "self_attn.out_proj.weight"] = attn["out"].reshape(H * Dh, D).T
        sd[pre + "fc1.weight"], sd[pre + "fc2.weight"] = mlp["wi"].T, mlp["wo"].T
        if cfg.enable_bias:
            for j, n in enumerate("qkv"):
                sd[pre + f"self_attn.{n}_proj.bias"] = attn["qkv_bias"][j].reshape(H * Dh)
            sd[pre + "self_attn.out_proj.bias"] = attn["out_bias"]
            sd[pre + "fc1.bias"], sd[pre + "fc2.bias"] = mlp["bi"], mlp["bo"]
        for ln, name in (("attn_ln", "self_attn_layer_norm"), ("mlp_ln", "final_layer_norm")):
            sd[pre + f"{name}.weight"] = layer[ln]["norm"]["scale"]
            sd[pre + f"{name}.bias"] = layer[ln]["norm"]["bias"]
    os.makedirs(path, exist_ok=True)
    config = {"model_type": "opt", "architectures": ["OPTForCausalLM"], "tie_word_embeddings": True,
              "layer_norm_elementwise_affine": True, **cfg.to_hf()}
    if not cfg.has_projection:
        config["word_embed_proj_dim"] = cfg.hidden_size
    write_safetensors(os.path.join(path, "model.safetensors"), {f"model.decoder.{k}": v for k, v in sd.items()})
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f, indent=1)
