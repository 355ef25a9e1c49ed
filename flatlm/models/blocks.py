"""The models' blocks, named from a parameter's path: what the per-block traces (flatlm.flatness.estimates) report
and what `train.flat.blocks` restricts a flatness-seeking objective to.

Names: "embed" (token / position embeddings and their LayerNorm), "layer_<i>/attn" and "layer_<i>/mlp" (each
sublayer with its own LayerNorm), "head" (the final LayerNorm and the MLM head), and for other models each top-level
module ("bilstm_0", ...; "tok_embed" -> "embed", "head*" -> "head"). "encoder" selects every block but the head.
"""

from __future__ import annotations

import jax

from flatlm.errors import UserError

ALL, ENCODER = "all", "encoder"


def path_names(path) -> tuple[str, ...]:
    """A `tree_flatten_with_path` key path as a tuple of strings (dict keys, attribute names, indices)."""
    names = []
    for k in path:
        for attr in ("key", "name", "idx"):
            if hasattr(k, attr):
                names.append(str(getattr(k, attr)))
                break
        else:
            names.append(str(k))
    return tuple(names)


def block_group(path: tuple[str, ...]) -> str:
    """The block of the parameter at `path` (see the module docstring)."""
    if not path:
        return "params"
    top = path[0]
    if top in ("tok_embed", "pos_embed", "embed_ln"):
        return "embed"
    if top == "final_ln" or top.startswith("head"):
        return "head"
    if top.startswith("layer_") and len(path) > 1:
        sub = path[1]
        return f"{top}/{'attn' if sub.startswith('attn') else 'mlp' if sub.startswith('mlp') else sub}"
    return top


def leaf_blocks(params) -> list[str]:
    """The block of every leaf of `params`, in `jax.tree.leaves` order."""
    return [block_group(path_names(p)) for p, _ in jax.tree_util.tree_flatten_with_path(params)[0]]


def parse_blocks(spec: str) -> tuple[str, ...]:
    """`spec` ("all", "encoder" or comma-separated block names) as a tuple of names; one line on a malformed one."""
    names = tuple(s.strip() for s in str(spec).split(","))
    if not all(names) or (len(names) > 1 and {ALL, ENCODER} & set(names)):
        raise UserError(f"config.train.flat.blocks={spec!r}: give 'all', 'encoder' or comma-separated block names "
                        "(e.g. 'embed,layer_0/attn')")
    return names


def block_mask(params, spec: str) -> list[bool]:
    """Per leaf of `params` (in `jax.tree.leaves` order): is it in the blocks `spec` names? An unknown block name,
    or a selection with no parameter, is one line listing the model's blocks."""
    names, blocks = parse_blocks(spec), leaf_blocks(params)
    if names == (ALL,):
        return [True] * len(blocks)
    if names == (ENCODER,):
        mask = [b != "head" for b in blocks]
    else:
        unknown = [n for n in names if n not in blocks]
        if unknown:
            raise UserError(f"config.train.flat.blocks names {', '.join(map(repr, unknown))}, not a block of this "
                            f"model; its blocks: {', '.join(dict.fromkeys(blocks))} (or 'all', 'encoder')")
        mask = [b in names for b in blocks]
    if not any(mask):
        raise UserError(f"config.train.flat.blocks={spec!r} selects no parameter of this model")
    return mask


def decay_mask(params):
    """Weight decay's mask, BERT's and the HF Trainer's no_decay: True on weight matrices and embeddings; False on
    biases (whatever their rank, e.g. the fused qkv_bias[3, H, Dh], and MLP / classifier biases named bi, bo, b:
    vectors) and LayerNorm scales. Read by name from the last dict key (a logical box's `.value` skipped)."""

    def decays(path, p) -> bool:
        keys = [str(k.key) for k in path if hasattr(k, "key")]
        name = keys[-1].lower() if keys else ""
        return len(getattr(p, "shape", ())) >= 2 and "bias" not in name

    return jax.tree_util.tree_map_with_path(decays, params)
