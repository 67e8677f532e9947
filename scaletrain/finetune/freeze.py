"""Which parameters train: freezing rules, and the trainable/total report of any model."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from torch import nn

log = logging.getLogger(__name__)


class FreezeError(ValueError):
    """A freezing rule that does not fit the model."""


def freeze_layers(model: nn.Module, *, embeddings: bool = True, first: int = 0,
                  train_last: int | None = None) -> None:
    """Freeze parts of a `Transformer` in place (everything else keeps its flag).

    `embeddings`: token (and position) embeddings; with a tied head that freezes the head too.
    `first`: the first N blocks. `train_last`: everything except the last K blocks, the final
    norm and the head.
    """
    n = len(model.layers)
    if first < 0 or first > n:
        raise FreezeError(f"finetune.freeze_first must be in [0, {n}] for this {n}-block model "
                          f"(got {first})")
    if train_last is not None and not 0 <= train_last <= n:
        raise FreezeError(f"finetune.train_last must be in [0, {n}] for this {n}-block model "
                          f"(got {train_last})")
    if embeddings:
        for module in (model.tok_embeddings, model.pos_embeddings):
            if module is not None:
                module.requires_grad_(False)
    blocks = list(model.layers.values())
    for block in blocks[:first]:
        block.requires_grad_(False)
    if train_last is not None:
        for module in model.children():
            if module not in (model.layers, model.norm, model.output):
                module.requires_grad_(False)
        for block in blocks[: n - train_last]:
            block.requires_grad_(False)


@dataclass(frozen=True)
class ParamReport:
    trainable: int
    total: int
    trainable_bytes: int
    frozen_bytes: int

    @property
    def fraction(self) -> float:
        return self.trainable / max(self.total, 1)


def train_norms(model: nn.Module) -> None:
    """Make every block norm (attention/ffn norms, Gemma 2's post-norms) and the final norm
    trainable; Qwen3's q/k norms stay frozen (`finetune.train_norms`)."""
    for name, module in model.named_modules():
        if name.endswith(("attention_norm", "ffn_norm")) or name == "norm":
            module.requires_grad_(True)


def _logical_numel(p: torch.Tensor) -> int:
    """Elements a parameter stands for (a packed 4-bit weight holds two per byte)."""
    shape = getattr(getattr(p, "quant_state", None), "shape", None)
    return int(torch.Size(shape).numel()) if shape is not None else p.numel()


def _nf4_parts(model: nn.Module) -> tuple[dict[int, int], dict[int, int]]:
    """The shardable NF4 layers' (`qlora_shard.NF4Linear`) parameters by id: (packed codes ->
    elements they stand for, scales -> bytes), counted as a bitsandbytes layer's are."""
    from scaletrain.finetune.qlora_shard import NF4Linear

    codes: dict[int, int] = {}
    stats: dict[int, int] = {}
    for m in model.modules():
        if isinstance(m, NF4Linear):
            codes[id(m.weight)] = int(torch.Size(m.shape).numel())
            stats[id(m.offset)] = 0  # what bitsandbytes' QuantState counts: not the offset,
            for t in (m.absmax, m.nested_absmax, m.code):  # the 4-bit code book
                stats[id(t)] = t.numel() * t.element_size()
    return codes, stats


def param_report(model: nn.Module) -> ParamReport:
    """Trainable and total parameters (shared ones counted once) and their storage bytes."""
    seen: set[int] = set()
    trainable = total = t_bytes = f_bytes = 0
    codes, stats = _nf4_parts(model)
    for p in model.parameters():
        if id(p) in seen or id(p) in stats:
            continue
        seen.add(id(p))
        n = codes.get(id(p)) or _logical_numel(p)
        nbytes = p.numel() * p.element_size()
        total += n
        if p.requires_grad:
            trainable += n
            t_bytes += nbytes
        else:
            f_bytes += nbytes
    return ParamReport(trainable, total, t_bytes, f_bytes)


def memory_report(model: nn.Module, optimizer_states: int = 2) -> dict[str, int]:
    """Bytes per component: frozen weights, trainable weights, gradients (fp32 as the params)
    and optimizer state (`optimizer_states` fp32 tensors per trainable parameter, 2 for AdamW).
    Quantization statistics of 4-bit weights are counted with the frozen weights."""
    r = param_report(model)
    quant_stats = sum(_nf4_parts(model)[1].values())
    for m in model.modules():
        qs = getattr(getattr(m, "weight", None), "quant_state", None)
        if qs is not None:
            for t in (qs.absmax, getattr(qs, "code", None)):
                if isinstance(t, torch.Tensor):
                    quant_stats += t.numel() * t.element_size()
            state2 = getattr(qs, "state2", None)
            if state2 is not None:
                quant_stats += state2.absmax.numel() * state2.absmax.element_size()
    return {
        "frozen_weights": r.frozen_bytes + quant_stats,
        "trainable_weights": r.trainable_bytes,
        "gradients": r.trainable_bytes,
        "optimizer_state": optimizer_states * r.trainable * 4,
    }


__all__ = ["freeze_layers", "train_norms", "param_report", "memory_report", "ParamReport",
           "FreezeError"]
