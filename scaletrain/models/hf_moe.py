"""Mixtral and Qwen3-MoE in Hugging Face format: config.json <-> `ModelArgs`, expert tensors.

Attention, norms and embeddings are those of Mistral (Mixtral) and Qwen3 (Qwen3-MoE), so the
dense family code in `hf_families.py` reads and writes them; this module adds the MoE MLP.

Checkpoint layout on the Hub, which transformers 5 also writes with `save_pretrained` (it fuses
the experts in memory into `experts.gate_up_proj` (E, 2I, D) and `experts.down_proj` (E, D, I)
when it loads, and splits them again when it saves):
- Mixtral: `model.layers.N.block_sparse_moe.gate.weight` (E, D) and
  `model.layers.N.block_sparse_moe.experts.{e}.w1|w3|w2.weight`;
- Qwen3-MoE: `model.layers.N.mlp.gate.weight` and `model.layers.N.mlp.experts.{e}.gate_proj|
  up_proj|down_proj.weight`.
Both per-expert names (Mixtral also under `mlp.`) and the fused in-memory names are read; the
per-expert Hub names are written. Our `GroupedExperts` holds w1/w3 (E, I, D) and w2 (E, D, I),
each expert in `nn.Linear`'s (out, in) layout, so every conversion is slicing or stacking.

What scaletrain does not model is refused: Qwen3-MoE dense layers (`mlp_only_layers`,
`decoder_sparse_step` != 1), Qwen2-MoE's gated shared expert, sigmoid routers, a nonzero
auxiliary-loss-free routing bias at export.
"""

from __future__ import annotations

import logging
import re
from typing import Any

import torch

from scaletrain.models.args import ModelArgs

logger = logging.getLogger(__name__)

MOE_MODEL_TYPES = ("mixtral", "qwen3_moe")
# The dense family whose attention, norms and config fields each MoE family shares.
DENSE_OF = {"mixtral": "mistral", "qwen3_moe": "qwen3"}
_ARCHITECTURES = {"mixtral": "MixtralForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM"}
# Our expert tensor -> the family's per-expert module name.
_EXPERT_NAMES = {
    "mixtral": {"w1": "w1", "w3": "w3", "w2": "w2"},
    "qwen3_moe": {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"},
}
_BLOCK = {"mixtral": "block_sparse_moe", "qwen3_moe": "mlp"}
_OURS = "feed_forward"


def refuse_other_moe(model_type: Any) -> None:
    """A clear error for MoE model types whose block scaletrain does not compute."""
    if model_type == "qwen2_moe":
        raise ValueError("model_type 'qwen2_moe' is not supported: its shared expert is scaled "
                         "by a sigmoid gate (shared_expert_gate) that scaletrain's MoE block "
                         "does not have; supported MoE types: mixtral, qwen3_moe")


# --- config.json -> ModelArgs ----------------------------------------------------------------
def moe_args(cfg: dict[str, Any], dense_args) -> ModelArgs:  # noqa: ANN001 (callable)
    """`ModelArgs` of a Mixtral or Qwen3-MoE config.json; `dense_args` reads the fields the
    dense family shares (`hf_families.rope_family_args`)."""
    family = cfg["model_type"]
    n_layers = int(cfg["num_hidden_layers"])
    n_experts = cfg.get("num_experts") or cfg.get("num_local_experts")
    if not n_experts:
        raise ValueError(f"a {family} config needs num_experts / num_local_experts > 0")
    dense = dict(cfg, model_type=DENSE_OF[family])
    extra: dict[str, Any] = {}
    if family == "qwen3_moe":
        if cfg.get("mlp_only_layers"):
            raise ValueError(f"mlp_only_layers {cfg['mlp_only_layers']} is not supported: "
                             "scaletrain has an MoE MLP in every layer")
        step = int(cfg.get("decoder_sparse_step", 1))
        if step != 1 and n_layers > 1:
            raise ValueError(f"decoder_sparse_step {step} is not supported: scaletrain has an "
                             "MoE MLP in every layer (decoder_sparse_step 1)")
        # Qwen3-MoE's window, when on, covers every layer (no max_window_layers).
        window = cfg.get("sliding_window") if cfg.get("use_sliding_window") else None
        dense["use_sliding_window"] = False
        extra = dict(moe_ffn_dim=int(cfg["moe_intermediate_size"]),
                     router_norm_topk=bool(cfg.get("norm_topk_prob", False)),
                     sliding_window=int(window) if window else None)
    elif float(cfg.get("router_jitter_noise") or 0.0) > 0:
        logger.warning("router_jitter_noise=%s is ignored: scaletrain routes without jitter "
                       "(it only acts in HF training)", cfg["router_jitter_noise"])
    args = dense_args(dense)
    return args.replace(family=family, n_experts=int(n_experts),
                        n_experts_per_token=int(cfg.get("num_experts_per_tok", 2)),
                        moe_aux_loss_coef=float(cfg.get("router_aux_loss_coef") or 0.0),
                        **extra)


# --- ModelArgs -> config.json ----------------------------------------------------------------
def check_moe_representable(args: ModelArgs) -> None:
    """Refuse MoE settings the family's transformers class would compute differently."""
    wrong = []
    if args.router_score != "softmax":
        wrong.append("router_score 'sigmoid' (HF routers use softmax)")
    if args.n_shared_experts:
        wrong.append("shared experts")
    if args.family == "mixtral" and not args.router_norm_topk:
        wrong.append("router_norm_topk false (Mixtral always renormalizes the top-k weights)")
    if wrong:
        raise ValueError(f"a {args.family} checkpoint cannot hold {'; '.join(wrong)}")
    if args.moe_capacity_factor is not None:
        logger.warning("moe_capacity_factor %s is not written: transformers' %s drops no "
                       "tokens", args.moe_capacity_factor, _ARCHITECTURES[args.family])


def moe_config(args: ModelArgs, dense_config) -> dict[str, Any]:  # noqa: ANN001 (callable)
    """config.json fields of a Mixtral or Qwen3-MoE model; `dense_config` writes the fields
    the dense family shares (`hf_families.rope_family_config`)."""
    family = args.family
    check_moe_representable(args)
    dense = args.replace(family=DENSE_OF[family])
    if family == "qwen3_moe" and args.sliding_window is not None:
        if args.sliding_window_pattern != 1:
            raise ValueError("a qwen3_moe checkpoint's window covers every layer "
                             "(sliding_window_pattern 1)")
        dense = dense.replace(sliding_window=None)
    cfg = dense_config(dense)
    cfg.update(architectures=[_ARCHITECTURES[family]], model_type=family,
               num_experts_per_tok=args.n_experts_per_token,
               router_aux_loss_coef=args.moe_aux_loss_coef, output_router_logits=False)
    if family == "mixtral":
        cfg.update(num_local_experts=args.n_experts, intermediate_size=args.expert_hidden_dim,
                   router_jitter_noise=0.0)
    else:
        for key in ("layer_types", "max_window_layers"):
            cfg.pop(key, None)
        cfg.update(num_experts=args.n_experts, moe_intermediate_size=args.expert_hidden_dim,
                   norm_topk_prob=args.router_norm_topk, decoder_sparse_step=1,
                   mlp_only_layers=[], use_sliding_window=args.sliding_window is not None,
                   sliding_window=args.sliding_window)
    return cfg


# --- state dicts -----------------------------------------------------------------------------
def moe_to_hf(sd: dict[str, torch.Tensor], args: ModelArgs
              ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """(the rest of our state dict, the MoE tensors under the Hub's per-expert names)."""
    rest: dict[str, torch.Tensor] = {}
    out: dict[str, torch.Tensor] = {}
    names, block = _EXPERT_NAMES[args.family], _BLOCK[args.family]
    for key, tensor in sd.items():
        m = re.fullmatch(rf"layers\.(\d+)\.{_OURS}\.(router\.gate\.weight|router\.expert_bias|"
                         r"experts\.(w1|w2|w3))", key)
        if m is None:
            rest[key] = tensor
            continue
        prefix = f"model.layers.{m.group(1)}.{block}"
        if m.group(2) == "router.gate.weight":
            out[f"{prefix}.gate.weight"] = tensor
        elif m.group(2) == "router.expert_bias":
            if torch.count_nonzero(tensor):
                raise ValueError(f"layer {m.group(1)}: the routing bias (moe_bias_update_rate) "
                                 f"is nonzero, and a {args.family} checkpoint has no place for "
                                 "it; export a model trained without the bias")
        else:
            for e, w in enumerate(tensor.unbind(0)):  # clones: safetensors refuses views
                out[f"{prefix}.experts.{e}.{names[m.group(3)]}.weight"] = w.clone()
    return rest, out


def moe_from_hf(hf_sd: dict[str, torch.Tensor], args: ModelArgs
                ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """(the HF tensors that are not MoE ones, our MoE tensors). Reads the per-expert Hub names
    and transformers' fused in-memory names; KeyError names a missing or extra expert."""
    rest: dict[str, torch.Tensor] = {}
    ours: dict[str, torch.Tensor] = {}
    reverse = {v: k for k, v in _EXPERT_NAMES[args.family].items()}
    experts: dict[tuple[int, str], dict[int, torch.Tensor]] = {}
    moe = r"model\.layers\.(\d+)\.(?:mlp|block_sparse_moe)\."
    for key, tensor in hf_sd.items():
        if m := re.fullmatch(moe + r"gate\.weight", key):
            ours[f"layers.{m.group(1)}.{_OURS}.router.gate.weight"] = tensor
        elif m := re.fullmatch(moe + r"experts\.(\d+)\.(\w+)\.weight", key):
            if m.group(3) not in reverse:
                raise KeyError(f"unexpected expert tensor {key!r} for a {args.family} model")
            experts.setdefault((int(m.group(1)), reverse[m.group(3)]), {})[int(m.group(2))] = \
                tensor
        elif m := re.fullmatch(moe + r"experts\.(gate_up_proj|down_proj)", key):
            i = m.group(1)
            if m.group(2) == "down_proj":
                ours[f"layers.{i}.{_OURS}.experts.w2"] = tensor
            else:
                w1, w3 = tensor.chunk(2, dim=1)
                ours[f"layers.{i}.{_OURS}.experts.w1"] = w1.contiguous()
                ours[f"layers.{i}.{_OURS}.experts.w3"] = w3.contiguous()
        else:
            rest[key] = tensor
    for (layer, name), by_index in sorted(experts.items()):
        if sorted(by_index) != list(range(args.n_experts)):
            raise KeyError(f"layer {layer}: expert tensors {name} for experts "
                           f"{sorted(by_index)}, the config says {args.n_experts} experts")
        ours[f"layers.{layer}.{_OURS}.experts.{name}"] = torch.stack(
            [by_index[e] for e in range(args.n_experts)])
    for layer in {int(k.split(".")[1]) for k in ours}:
        gate = ours.get(f"layers.{layer}.{_OURS}.router.gate.weight")
        if gate is not None:
            ours[f"layers.{layer}.{_OURS}.router.expert_bias"] = torch.zeros(
                args.n_experts, dtype=gate.dtype)
    return rest, ours


__all__ = ["MOE_MODEL_TYPES", "DENSE_OF", "moe_args", "moe_config", "moe_to_hf", "moe_from_hf",
           "check_moe_representable", "refuse_other_moe"]
