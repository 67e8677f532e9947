"""Mixture-of-Experts metrics at log steps: expert load, router entropy, auxiliary loss.

Each MoE layer counts the (token, expert) choices of its training forward passes on the device
(`MoE.tokens_per_expert`, no host synchronization); at a log step the counts of the interval
are summed over the data-parallel ranks, gathered from every pipeline stage, written to
metrics.jsonl (per layer) and TensorBoard (averages over layers), and reset.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from scaletrain.models.moe import moe_layers
from scaletrain.parallel.parallelize import Parallelism, clean_name


def collect_moe_stats(model: nn.Module, par: Parallelism) -> dict[str, Any] | None:
    """The interval's MoE statistics of the whole model (every rank must call it: it runs
    collectives), or None for a dense model."""
    layers = [(clean_name(name), m) for name, m in moe_layers(model)]
    local: dict[str, dict[str, Any]] = {}
    if layers:
        loads = torch.stack([m.tokens_per_expert for _, m in layers]).float()
        par.all_reduce(loads, "dp_cp")
        nan = torch.tensor(float("nan"), device=loads.device)
        extra = torch.stack([torch.stack([
            m.last_entropy if m.last_entropy is not None else nan,
            m.last_aux_loss if m.last_aux_loss is not None else nan]).float()
            for _, m in layers])
        par.all_reduce(extra, "dp_cp")
        extra = extra / max(par.dp_size * par.dims.cp, 1)
        for (name, m), load, (entropy, aux) in zip(layers, loads.cpu().tolist(),
                                                   extra.cpu().tolist(), strict=True):
            m.tokens_per_expert.zero_()
            mean = sum(load) / len(load)
            local[name] = {"tokens_per_expert": [int(x) for x in load],
                           "load_max_over_mean": max(load) / mean if mean else None,
                           "router_entropy": entropy,
                           "aux_loss": None if aux != aux else aux}  # NaN: no aux loss
    merged: dict[str, dict[str, Any]] = {}
    for part in par.gather_objects(local) if par.dims.pp > 1 else [local]:
        merged.update(part)
    if not merged:
        return None
    return {"layers": merged, **_averages(merged)}


def _averages(layers: dict[str, dict[str, Any]]) -> dict[str, float | None]:
    out: dict[str, float | None] = {}
    for key in ("load_max_over_mean", "router_entropy", "aux_loss"):
        values = [v[key] for v in layers.values() if v[key] is not None]
        out[key] = sum(values) / len(values) if values else None
    return out
