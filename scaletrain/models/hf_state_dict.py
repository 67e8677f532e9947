"""Our state dict <-> Hugging Face names and layouts, for every family `models.hf` reads.

Llama-layout families map by plain renaming (per-family layer names in `hf_families.py`);
Phi-3's fused projections are split at load and fused again at export; GPT-2's `Conv1D`
weights (stored [in, out]) are transposed and its fused `c_attn` (q, k, v) split; MoE
experts go through `hf_moe.py`. Plain state dicts only: no files, no distributed code.
"""

from __future__ import annotations

import re

import torch

from scaletrain.models.args import ModelArgs
from scaletrain.models.hf_families import LLAMA_LAYER, fused_map, layer_map
from scaletrain.models.hf_moe import moe_from_hf, moe_to_hf
from scaletrain.models.transformer import Transformer

# Buffers some HF checkpoints carry that hold no learned weights.
_IGNORED_HF_KEYS = re.compile(r"(\.attn\.(bias|masked_bias)|\.rotary_emb\.inv_freq)$")

_LLAMA_LAYER = LLAMA_LAYER  # the name finetune/peft_io.py imported
_LLAMA_TOP = {
    "tok_embeddings.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_GPT2_LAYER = {  # Linear-like modules other than the fused c_attn
    "attention.wo": "attn.c_proj",
    "feed_forward.w1": "mlp.c_fc",
    "feed_forward.w2": "mlp.c_proj",
    "attention_norm": "ln_1",
    "ffn_norm": "ln_2",
}
_GPT2_TOP = {
    "tok_embeddings.weight": "transformer.wte.weight",
    "pos_embeddings.weight": "transformer.wpe.weight",
    "norm.weight": "transformer.ln_f.weight",
    "norm.bias": "transformer.ln_f.bias",
    "output.weight": "lm_head.weight",
}
_CONV1D = ("attn.c_proj", "mlp.c_fc", "mlp.c_proj")  # HF GPT-2 modules stored [in, out]


def _layer_key(key: str) -> tuple[int, str, str] | None:
    """`layers.3.attention.wq.weight` -> (3, "attention.wq", "weight")."""
    m = re.fullmatch(r"layers\.(\d+)\.(.+)\.(weight|bias)", key)
    return (int(m.group(1)), m.group(2), m.group(3)) if m else None


def to_hf_state_dict(sd: dict[str, torch.Tensor], args: ModelArgs) -> dict[str, torch.Tensor]:
    """Our state dict -> HF names and layouts (contiguous tensors, the tied head left out)."""
    out: dict[str, torch.Tensor] = {}
    if args.is_moe:
        sd, out = moe_to_hf(sd, args)
    gpt2 = args.arch == "gpt2"
    top, layers = (_GPT2_TOP, _GPT2_LAYER) if gpt2 else (_LLAMA_TOP, layer_map(args))
    prefix = "transformer.h" if gpt2 else "model.layers"
    fused = fused_map(args)
    fused_parts = {part for parts in fused.values() for part in parts}
    for key, tensor in sd.items():
        if key == "output.weight" and args.tie_embeddings:
            continue
        if key in top:
            out[top[key]] = tensor
            continue
        parsed = _layer_key(key)
        if parsed is None:
            raise KeyError(f"unexpected key {key!r} in a scaletrain state dict")
        i, module, param = parsed
        if gpt2 and module in ("attention.wq", "attention.wk", "attention.wv"):
            continue  # fused below
        if module in fused_parts:
            continue  # fused below
        hf_module = layers[module]
        if gpt2 and hf_module in _CONV1D and param == "weight":
            tensor = tensor.t()
        out[f"{prefix}.{i}.{hf_module}.{param}"] = tensor
    if gpt2:
        for i in range(args.n_layers):
            parts = [f"layers.{i}.attention.{w}" for w in ("wq", "wk", "wv")]
            out[f"{prefix}.{i}.attn.c_attn.weight"] = torch.cat(
                [sd[p + ".weight"] for p in parts], dim=0
            ).t()
            out[f"{prefix}.{i}.attn.c_attn.bias"] = torch.cat([sd[p + ".bias"] for p in parts])
    for i in range(args.n_layers if fused else 0):
        for hf_module, parts in fused.items():
            out[f"{prefix}.{i}.{hf_module}.weight"] = torch.cat(
                [sd[f"layers.{i}.{p}.weight"] for p in parts], dim=0)
    return {k: v.contiguous() for k, v in out.items()}


def from_hf_state_dict(
    hf_sd: dict[str, torch.Tensor], args: ModelArgs
) -> dict[str, torch.Tensor]:
    """HF names and layouts -> our state dict (both embedding keys set when tied).

    Raises KeyError naming any tensor that does not belong to the model `args` describes.
    """
    gpt2 = args.arch == "gpt2"
    top, layers = (_GPT2_TOP, _GPT2_LAYER) if gpt2 else (_LLAMA_TOP, layer_map(args))
    rev_top = {v: k for k, v in top.items()}
    rev_layer = {v: k for k, v in layers.items()}
    fused_mods = fused_map(args)
    sd: dict[str, torch.Tensor] = {}
    if args.is_moe:
        hf_sd, sd = moe_from_hf(hf_sd, args)
    unknown: list[str] = []
    for key, tensor in hf_sd.items():
        if _IGNORED_HF_KEYS.search(key):
            continue
        name = key
        if gpt2 and not name.startswith(("transformer.", "lm_head.")):
            name = "transformer." + name  # GPT2Model checkpoints have no prefix
        if name in rev_top:
            sd[rev_top[name]] = tensor
            continue
        pattern = r"transformer\.h\.(\d+)\.(.+)\.(weight|bias)" if gpt2 else (
            r"model\.layers\.(\d+)\.(.+)\.(weight|bias)"
        )
        m = re.fullmatch(pattern, name)
        if m is None or (m.group(2) not in rev_layer and m.group(2) != "attn.c_attn"
                         and m.group(2) not in fused_mods):
            unknown.append(key)
            continue
        i, hf_module, param = int(m.group(1)), m.group(2), m.group(3)
        if hf_module in fused_mods:
            _split_fused(sd, tensor, i, param, fused_mods[hf_module], args)
            continue
        if gpt2 and hf_module == "attn.c_attn":
            fused = tensor.t() if param == "weight" else tensor
            for w, part in zip(("wq", "wk", "wv"), fused.chunk(3, dim=0)):
                sd[f"layers.{i}.attention.{w}.{param}"] = part
            continue
        if gpt2 and hf_module in _CONV1D and param == "weight":
            tensor = tensor.t()
        sd[f"layers.{i}.{rev_layer[hf_module]}.{param}"] = tensor
    if unknown:
        shown = ", ".join(unknown[:5]) + (" ..." if len(unknown) > 5 else "")
        raise KeyError(f"{len(unknown)} tensor(s) do not belong to a {args.family} model: {shown}")
    if args.tie_embeddings and "tok_embeddings.weight" in sd:
        sd["output.weight"] = sd["tok_embeddings.weight"]
    return sd


def _split_fused(sd: dict[str, torch.Tensor], tensor: torch.Tensor, layer: int, param: str,
                 parts: tuple[str, ...], args: ModelArgs) -> None:
    """A fused projection (Phi-3 qkv_proj, gate_up_proj) -> our separate ones."""
    sizes = {"attention.wq": args.n_heads * args.head_dim,
             "attention.wk": args.kv_heads * args.head_dim,
             "attention.wv": args.kv_heads * args.head_dim,
             "feed_forward.w1": args.hidden_dim, "feed_forward.w3": args.hidden_dim}
    split = [sizes[p] for p in parts]
    if tensor.shape[0] != sum(split):
        raise KeyError(f"layer {layer}: fused tensor of {tensor.shape[0]} rows, the config "
                       f"says {sum(split)} ({' + '.join(map(str, split))})")
    for part, piece in zip(parts, tensor.split(split, dim=0), strict=True):
        sd[f"layers.{layer}.{part}.{param}"] = piece


def load_state_dict_checked(model: Transformer, sd: dict[str, torch.Tensor], source: str) -> None:
    """`model.load_state_dict(sd)` with an error that names `source` and the offending keys."""
    expected = set(model.state_dict())
    missing = sorted(expected - set(sd))
    extra = sorted(set(sd) - expected)
    if missing or extra:
        parts = []
        if missing:
            parts.append(f"missing tensor(s): {', '.join(missing[:5])}"
                         + (" ..." if len(missing) > 5 else ""))
        if extra:
            parts.append(f"unexpected tensor(s): {', '.join(extra[:5])}"
                         + (" ..." if len(extra) > 5 else ""))
        raise ValueError(f"{source}: " + "; ".join(parts))
    for key, tensor in model.state_dict().items():
        if tuple(sd[key].shape) != tuple(tensor.shape):
            raise ValueError(
                f"{source}: tensor {key} has shape {tuple(sd[key].shape)}, the config says "
                f"{tuple(tensor.shape)}"
            )
    with torch.no_grad():
        model.load_state_dict(sd, strict=True)
