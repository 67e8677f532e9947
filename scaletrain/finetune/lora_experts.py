"""LoRA on the routed experts of an MoE block, in PEFT's parametrization of MoE experts.

Experts are stacked 3-D parameters (`GroupedExperts`: w1, w3 (E, I, D), w2 (E, D, I)), not
`nn.Linear`s. PEFT (0.21, `target_parameters`) adapts transformers 5's fused expert tensors
`experts.gate_up_proj` (E, 2I, D) and `experts.down_proj` (E, D, I) with one rank-r update per
expert, delta W[e] = (alpha / r) B[e] A[e]. `LoRAExperts` holds the same factors:
- gate/up: A (E, r, D) and B (E, 2I, r), one adapter over [w1; w3] (gate rows first), so the
  targets `gate` and `up` go together on an MoE model;
- down: A (E, r, I) and B (E, D, r).
The update is computed from the factors (x A^T, then B^T per expert, as grouped GEMMs), never as a
dense (E, out, in) tensor. B starts at zero, so a fresh adapter is an exact no-op.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from scaletrain.models.moe import GroupedExperts, MoE, _compute_dtype, _gmm, _local
from scaletrain.train.step import full_value

# Our short targets that act on the experts of an MoE block, and PEFT's parameter names.
EXPERT_TARGETS = ("gate", "up", "down")
PEFT_PARAMETERS = {"gate_up": "mlp.experts.gate_up_proj", "down": "mlp.experts.down_proj"}


class ExpertLoRAError(ValueError):
    """An expert LoRA setting that cannot be applied; the message names the fix."""


def _factors(n: int, rank: int, in_features: int, out_features: int, like: torch.Tensor
             ) -> tuple[nn.Parameter, nn.Parameter]:
    """A ~ Kaiming-uniform per expert (as nn.Linear), B = 0."""
    dtype = like.dtype if like.is_floating_point() else torch.float32
    a = torch.empty(n, rank, in_features, device=like.device, dtype=dtype)
    for e in range(n):
        nn.init.kaiming_uniform_(a[e], a=math.sqrt(5))
    b = torch.zeros(n, out_features, rank, device=like.device, dtype=dtype)
    return nn.Parameter(a), nn.Parameter(b)


class LoRAExperts(nn.Module):
    """`base` (frozen `GroupedExperts`) plus per-expert low-rank updates of gate/up and down."""

    def __init__(self, base: GroupedExperts, rank: int, alpha: float, gate_up: bool,
                 down: bool) -> None:
        super().__init__()
        if rank <= 0:
            raise ExpertLoRAError(f"finetune.lora_rank must be positive (got {rank})")
        n, hidden, dim = base.w1.shape
        self.base = base
        self.rank, self.alpha, self.scaling = rank, alpha, alpha / rank
        self.gate_up_A = self.gate_up_B = self.down_A = self.down_B = None
        if gate_up:
            self.gate_up_A, self.gate_up_B = _factors(n, rank, dim, 2 * hidden, base.w1)
        if down:
            self.down_A, self.down_B = _factors(n, rank, hidden, dim, base.w2)
        for p in base.parameters():
            p.requires_grad_(False)

    @property
    def parts(self) -> tuple[str, ...]:
        """Which of 'gate_up' and 'down' carry an adapter."""
        return tuple(p for p in ("gate_up", "down") if getattr(self, f"{p}_A") is not None)

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """Same contract as `GroupedExperts.forward`: `x` sorted by expert, `counts` per expert."""
        b = self.base
        w1, w2, w3 = (_local(w) for w in (b.w1, b.w2, b.w3))
        if w1.shape[0] != counts.shape[0] or w1.shape[0] != self._n():
            raise ExpertLoRAError("LoRA on experts needs every expert on the rank (no expert "
                                  "parallelism)")
        dtype = _compute_dtype(x, w1)
        x = x.to(dtype)
        mm = _matmul_per_expert(counts, b.compute)
        gate, up = mm(x, w1.to(dtype)), mm(x, w3.to(dtype))
        if self.gate_up_A is not None:
            a, b_ = _aligned(self.gate_up_A.to(dtype), self.gate_up_B.to(dtype))
            update = mm(mm(x, a), b_) * self.scaling
            d_gate, d_up = update.chunk(2, dim=-1)
            gate, up = gate + d_gate, up + d_up
        h = F.silu(gate) * up
        out = mm(h, w2.to(dtype))
        if self.down_A is not None:
            a, b_ = _aligned(self.down_A.to(dtype), self.down_B.to(dtype))
            out = out + mm(mm(h, a), b_) * self.scaling
        return out

    def _n(self) -> int:
        return self.base.w1.shape[0]

    @torch.no_grad()
    def delta(self, part: str) -> torch.Tensor:
        """The dense per-expert update (E, out, in) of 'gate_up' ([w1; w3]) or 'down', fp32."""
        a, b = getattr(self, f"{part}_A"), getattr(self, f"{part}_B")
        return torch.bmm(b.float(), a.float()) * self.scaling


def _aligned(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A (E, r, in), B (E, out, r) with the rank zero-padded to a multiple of 16 bytes:
    `torch._grouped_mm` needs 16-byte strides (rank 4 in bf16 is 8 bytes). The zero rows of A
    and columns of B add exact zeros."""
    step = max(1, 16 // a.element_size())
    pad = -a.shape[1] % step
    if pad == 0:
        return a, b
    return F.pad(a, (0, 0, 0, pad)), F.pad(b, (0, pad))


def _matmul_per_expert(counts: torch.Tensor, compute: str
                       ) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """(x sorted by expert, w (E, out, in)) -> x_e @ w[e]^T for each expert's rows."""
    if compute == "loop":
        sizes = counts.tolist()

        def loop(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
            parts = [part @ w[e].t() for e, part in enumerate(torch.split(x, sizes))]
            return torch.cat(parts) if parts else x.new_zeros(0, w.shape[1])
        return loop
    offs = torch.cumsum(counts, 0, dtype=torch.int32)
    return lambda x, w: _gmm(x, w, offs)


def expert_adapters(model: nn.Module) -> dict[str, LoRAExperts]:
    """Name (as in the state dict, wrappers stripped) -> expert LoRA."""
    out = {}
    for name, module in model.named_modules():
        if isinstance(module, LoRAExperts):
            out[name.replace("_checkpoint_wrapped_module.", "").replace("_orig_mod.", "")] = module
    return out


def wrap_block_experts(block: nn.Module, targets: tuple[str, ...], rank: int, alpha: float,
                       dropout: float) -> LoRAExperts | None:
    """Wrap the experts of `block`'s MoE MLP for the targets gate/up/down it is given (gate and
    up go together: PEFT adapts them as one fused tensor); None for a dense block."""
    moe = getattr(block, "feed_forward", None)
    chosen = [t for t in EXPERT_TARGETS if t in targets]
    if not isinstance(moe, MoE) or not chosen:
        return None
    if ("gate" in chosen) != ("up" in chosen):
        raise ExpertLoRAError("on an MoE model LoRA adapts each expert's gate and up "
                              "projections as one (PEFT's experts.gate_up_proj): put both gate "
                              "and up in finetune.lora_targets, or neither")
    if dropout > 0:
        raise ExpertLoRAError("LoRA on experts has no dropout (PEFT refuses lora_dropout with "
                              "expert parameters): set finetune.lora_dropout 0, or drop "
                              "gate,up,down from finetune.lora_targets")
    base = moe.experts
    if isinstance(base, LoRAExperts):
        raise ExpertLoRAError("the experts already carry a LoRA adapter")
    lora = LoRAExperts(base, rank, alpha, gate_up="gate" in chosen, down="down" in chosen)
    moe.experts = lora
    return lora


@torch.no_grad()
def merge_expert_lora(model: nn.Module) -> int:
    """Fold every expert adapter into its stacked weights and put `GroupedExperts` back."""
    count = 0
    for module in list(model.modules()):
        if isinstance(module, MoE) and isinstance(module.experts, LoRAExperts):
            lora = module.experts
            base = lora.base
            if lora.gate_up_A is not None:
                d_gate, d_up = lora.delta("gate_up").chunk(2, dim=1)
                base.w1 += d_gate.to(base.w1.dtype)
                base.w3 += d_up.to(base.w3.dtype)
            if lora.down_A is not None:
                base.w2 += lora.delta("down").to(base.w2.dtype)
            module.experts = base
            count += 1
    return count


# --- PEFT's tensor layout of `target_parameters` (ParamWrapper) -------------------------------
def to_peft(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Ours A (E, r, in), B (E, out, r) -> PEFT's lora_A (E*r, in), expert-major, and lora_B
    (out, r*E), rank-major (PEFT reshapes it to (out, r, E))."""
    n, r, _ = a.shape
    return a.reshape(n * r, a.shape[2]), b.permute(1, 2, 0).reshape(b.shape[1], r * n)


def from_peft(a: torch.Tensor, b: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The inverse of `to_peft` for `n` experts."""
    if a.shape[0] % n or b.shape[1] != a.shape[0]:
        raise ExpertLoRAError(f"expert LoRA of shapes {tuple(a.shape)} and {tuple(b.shape)} "
                              f"does not fit {n} experts")
    r = a.shape[0] // n
    return a.reshape(n, r, a.shape[1]), b.reshape(b.shape[0], r, n).permute(2, 0, 1)


def _peft_module(layer: str, part: str, parts: tuple[str, ...]) -> str:
    """PEFT nests one ParamWrapper per targeted parameter, in the order the module registers
    them (gate_up_proj, then down_proj): with both, gate_up's adapter is under `base_layer`."""
    nested = ".base_layer" if part == "gate_up" and len(parts) == 2 else ""
    return f"model.layers.{layer}.mlp.experts{nested}"


def peft_expert_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """PEFT's tensors (module name without the `base_model.model.` prefix) of every expert
    adapter of `model`."""
    out = {}
    for name, lora in expert_adapters(model).items():
        layer = name.split(".")[1]
        for part in lora.parts:
            a, b = to_peft(full_value(getattr(lora, f"{part}_A")),
                           full_value(getattr(lora, f"{part}_B")))
            module = _peft_module(layer, part, lora.parts)
            out[f"{module}.lora_A.weight"], out[f"{module}.lora_B.weight"] = a, b
    return out


def targets_of_parameters(names: list[str]) -> tuple[str, ...]:
    """PEFT `target_parameters` -> our short targets; ExpertLoRAError for any other tensor."""
    reverse = {"gate_up_proj": ("gate", "up"), "down_proj": ("down",)}
    out: list[str] = []
    for name in names:
        last = name.rpartition(".")[2]
        if not name.endswith("experts." + last) or last not in reverse:
            raise ExpertLoRAError(f"target_parameters entry {name!r} is not supported (only "
                                  f"{', '.join(PEFT_PARAMETERS.values())})")
        out += reverse[last]
    return tuple(out)


@torch.no_grad()
def load_peft_expert_tensors(model: nn.Module, tensors: dict[str, torch.Tensor]) -> set[str]:
    """Copy PEFT expert tensors (names as `peft_expert_tensors` gives) into `model`'s expert
    adapters; returns the names used. ExpertLoRAError names a missing tensor."""
    used = set()
    for name, lora in expert_adapters(model).items():
        layer = name.split(".")[1]
        for part in lora.parts:
            module = _peft_module(layer, part, lora.parts)
            keys = [f"{module}.lora_{x}.weight" for x in "AB"]
            if any(k not in tensors for k in keys):
                raise ExpertLoRAError(f"the adapter lacks {keys[0]} / {keys[1]}")
            a, b = from_peft(tensors[keys[0]], tensors[keys[1]], lora._n())
            ours_a, ours_b = getattr(lora, f"{part}_A"), getattr(lora, f"{part}_B")
            if a.shape != ours_a.shape or b.shape != ours_b.shape:
                raise ExpertLoRAError(f"{module}: adapter of shapes {tuple(a.shape)}, "
                                      f"{tuple(b.shape)}; the model needs {tuple(ours_a.shape)}, "
                                      f"{tuple(ours_b.shape)}")
            ours_a.copy_(a)
            ours_b.copy_(b)
            used.update(keys)
    return used


__all__ = ["LoRAExperts", "ExpertLoRAError", "EXPERT_TARGETS", "PEFT_PARAMETERS",
           "expert_adapters", "wrap_block_experts", "merge_expert_lora", "to_peft", "from_peft",
           "peft_expert_tensors", "targets_of_parameters", "load_peft_expert_tensors"]
