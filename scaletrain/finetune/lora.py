"""LoRA: a frozen linear layer plus a trainable low-rank update, `W x + (alpha / r) B A x`.

`LoRALinear` wraps any linear-like module (`nn.Linear` or a bitsandbytes 4-bit layer): the
wrapped layer moves to `<name>.base`, the adapter is `<name>.lora_A` / `<name>.lora_B` (PEFT's
names). `B` starts at zero, so a fresh adapter is an exact no-op.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

import torch
from torch import nn

from scaletrain.finetune.lora_fused import lora_linear
from scaletrain.finetune.qlora import dequantize_weight, is_nf4
from scaletrain.finetune.qlora_shard import NF4Linear
from scaletrain.models.linears import BLOCK_LINEARS

log = logging.getLogger(__name__)

# Short target names -> our module names inside a block (and the HF Llama names PEFT uses).
TARGETS: dict[str, str] = BLOCK_LINEARS
HF_TARGETS: dict[str, str] = {
    "q": "q_proj", "k": "k_proj", "v": "v_proj", "o": "o_proj",
    "gate": "gate_proj", "up": "up_proj", "down": "down_proj",
}
# Phi-3 checkpoints fuse projections: their HF names stand for several of ours.
HF_FUSED_TARGETS: dict[str, tuple[str, ...]] = {"qkv_proj": ("q", "k", "v"),
                                                "gate_up_proj": ("gate", "up")}


class LoRAError(ValueError):
    """A LoRA setting that cannot be applied; the message names the fix."""


@dataclass(frozen=True)
class LoRASettings:
    rank: int = 8
    alpha: float = 16.0
    dropout: float = 0.0
    targets: tuple[str, ...] = ("q", "k", "v", "o", "gate", "up", "down")

    @property
    def scaling(self) -> float:
        return self.alpha / self.rank


def parse_targets(text: str | list[str] | tuple[str, ...]) -> tuple[str, ...]:
    """'q,v' or HF names 'q_proj,v_proj' -> ('q', 'v'); an unknown name is an error."""
    items = [t.strip() for t in (text.split(",") if isinstance(text, str) else text)]
    reverse = {v: k for k, v in HF_TARGETS.items()}
    out: list[str] = []
    for item in filter(None, items):
        if item in HF_FUSED_TARGETS:
            out += [t for t in HF_FUSED_TARGETS[item] if t not in out]
            continue
        short = reverse.get(item, item)
        if short not in TARGETS:
            raise LoRAError(
                f"LoRA target module '{item}' matches no layer; choose among "
                f"{', '.join(TARGETS)} (or the Hugging Face names "
                f"{', '.join([*HF_TARGETS.values(), *HF_FUSED_TARGETS])})"
            )
        if short not in out:
            out.append(short)
    if not out:
        raise LoRAError("finetune.lora_targets is empty; name at least one module, e.g. q,v")
    return tuple(out)


def _in_out(base: nn.Module) -> tuple[int, int]:
    return int(base.in_features), int(base.out_features)


class LoRALinear(nn.Module):
    """`base(x) + scaling * lora_B(lora_A(dropout(x)))` with `base` frozen."""

    def __init__(self, base: nn.Module, rank: int, alpha: float, dropout: float = 0.0) -> None:
        super().__init__()
        if rank <= 0:
            raise LoRAError(f"finetune.lora_rank must be positive (got {rank})")
        in_features, out_features = _in_out(base)
        self.base = base
        self.rank, self.alpha, self.scaling = rank, alpha, alpha / rank
        weight = base.weight
        dtype = weight.dtype if weight.is_floating_point() else torch.float32
        # A base on the meta device (a sharded load fills it later): the adapter is made for
        # real, from the seed, as in one process
        device = "cpu" if weight.is_meta else weight.device
        self.lora_A = nn.Linear(in_features, rank, bias=False, device=device, dtype=dtype)
        self.lora_B = nn.Linear(rank, out_features, bias=False, device=device, dtype=dtype)
        self.dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        self.fused: str | None = None
        """`dense` or `nf4`: the base and adapter run as one node (`lora_fused.py`); None
        (dropout, or another kind of base): composed by autograd."""
        if dropout == 0:
            self.fused = "dense" if type(base) is nn.Linear else "nf4" if is_nf4(base) or \
                isinstance(base, NF4Linear) else None
        self.reset_lora()
        for p in self.base.parameters():
            p.requires_grad_(False)

    @property
    def in_features(self) -> int:
        return self.lora_A.in_features

    @property
    def out_features(self) -> int:
        return self.lora_B.out_features

    @torch.no_grad()
    def reset_lora(self) -> None:
        """A ~ Kaiming-uniform (as nn.Linear), B = 0: the adapter starts as an exact no-op."""
        nn.init.kaiming_uniform_(self.lora_A.weight, a=math.sqrt(5))
        nn.init.zeros_(self.lora_B.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """A dense or NF4 base without dropout takes the fused path (`lora_fused.py`: no
        full-size update tensor, no stored 16-bit weight copy). Otherwise (dropout): no
        extra full-size activation beyond dropout's, no dtype copy of `x` under autocast (the
        matmul casts), and the scaling applied to the r-wide intermediate."""
        if self.fused is not None:
            base, nf4 = self.base, self.fused == "nf4"
            # a bitsandbytes layer, or its shardable form under data parallelism (`dense`)
            dense = getattr(base, "dense", dequantize_weight) if nf4 else None
            return lora_linear(x, base.weight, base.bias, self.lora_A.weight, self.lora_B.weight,
                               self.scaling, dense=dense,
                               compute_dtype=base.compute_dtype if nf4 else None)
        out = self.base(x)
        h = self.dropout(x) if isinstance(self.dropout, nn.Dropout) else x
        if h.dtype != self.lora_A.weight.dtype and not torch.is_autocast_enabled(h.device.type):
            h = h.to(self.lora_A.weight.dtype)
        update = self.lora_B(self.lora_A(h) * self.scaling)
        if update.dtype != out.dtype:
            update = update.to(out.dtype)
        return out + update

    def delta_weight(self) -> torch.Tensor:
        """The dense update `scaling * B @ A` of shape (out, in), in fp32."""
        return (self.lora_B.weight.float() @ self.lora_A.weight.float()) * self.scaling


def adapter_modules(model: nn.Module) -> dict[str, LoRALinear]:
    """Name (as in the state dict, wrappers stripped) -> LoRA layer."""
    out = {}
    for name, module in model.named_modules():
        if isinstance(module, LoRALinear):
            out[name.replace("_checkpoint_wrapped_module.", "").replace("_orig_mod.", "")] = module
    return out


def apply_lora(model: nn.Module, settings: LoRASettings) -> dict[str, LoRALinear]:
    """Freeze `model` and wrap the target linears of every block in `model.layers`.

    Returns the new LoRA layers by name. Raises LoRAError when a target matches no layer of this
    model (e.g. `up` on a GPT-2 model, which has no gated MLP).
    """
    from scaletrain.finetune.lora_experts import ExpertLoRAError, wrap_block_experts

    for p in model.parameters():
        p.requires_grad_(False)
    added: dict[str, LoRALinear] = {}
    missing = set(settings.targets)
    experts = 0
    for block_name, block in model.layers.items():
        try:  # MoE blocks: gate/up/down adapt the routed experts (lora_experts.py)
            wrapped = wrap_block_experts(block, settings.targets, settings.rank, settings.alpha,
                                         settings.dropout)
        except ExpertLoRAError as e:
            raise LoRAError(str(e)) from None
        if wrapped is not None:
            experts += 1
            missing -= {"gate", "up", "down"} & set(settings.targets)
        for short in settings.targets:
            parent_name, _, attr = TARGETS[short].rpartition(".")
            parent = block.get_submodule(parent_name)
            base = getattr(parent, attr, None)
            if base is None:
                continue
            missing.discard(short)
            lora = LoRALinear(base, settings.rank, settings.alpha, settings.dropout)
            setattr(parent, attr, lora)
            added[f"layers.{block_name}.{TARGETS[short]}"] = lora
    if missing:
        raise LoRAError(
            f"LoRA target(s) {', '.join(sorted(missing))} match no layer of this "
            f"{getattr(getattr(model, 'args', None), 'arch', '')} model; drop them from "
            "finetune.lora_targets"
        )
    log.info("LoRA: rank %d, alpha %g on %d layers%s (%s)", settings.rank, settings.alpha,
             len(added), f" and the experts of {experts} MoE blocks" if experts else "",
             ",".join(settings.targets))
    return added


@torch.no_grad()
def merge_lora(model: nn.Module) -> int:
    """Fold every adapter into its base weight and put the plain layer back; returns the count.

    The base must be a dense `nn.Linear` (merge a QLoRA adapter into the full-precision base).
    Expert adapters of MoE blocks are folded into the stacked expert weights.
    """
    from scaletrain.finetune.lora_experts import merge_expert_lora

    count = merge_expert_lora(model)
    layers = [(n, m) for n, m in model.named_modules() if isinstance(m, LoRALinear)]
    for name, lora in layers:
        base = lora.base
        if not isinstance(base, nn.Linear) or type(base) is not nn.Linear:
            raise LoRAError(f"{name}: cannot merge into a {type(base).__name__}; load the "
                            "full-precision base model and merge into it")
        base.weight += lora.delta_weight().to(base.weight.dtype)
        parent_name, _, attr = name.rpartition(".")
        setattr(model.get_submodule(parent_name), attr, base)
        count += 1
    return count


__all__ = ["LoRALinear", "LoRASettings", "LoRAError", "TARGETS", "HF_TARGETS", "apply_lora",
           "merge_lora", "adapter_modules", "parse_targets"]
