"""Sharded loading of a fine-tuning base: the model is built on the meta device, the method
applied (adapters and heads are created for real, from the seed, as in one process), the whole
layout applied (tensor parallel, then FSDP2 or DDP's replicas of the TP shards), and only then
is each rank's part of each base tensor read from the checkpoint (`checkpoint.sharded_load`):
the region its DTensor holds (Shard(0)/Shard(1) over `tp`, FSDP's dim-0 shards over those, the
experts an FSDP or TP rank holds of an MoE base). No rank holds more than its part.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Collection
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from scaletrain.checkpoint.sharded_load import (
    LoadReport,
    LoadTimer,
    fill_regions,
    load_native_regions,
    local_region,
)
from scaletrain.inference.loader import LoadedModel
from scaletrain.models.hf import CONFIG_NAME, hf_slices
from scaletrain.models.rope import inverse_frequencies
from scaletrain.models.transformer import Transformer

log = logging.getLogger(__name__)

# Wrappers that rename parameters (activation checkpointing, torch.compile, FSDP1-style) and a
# LoRA layer's frozen `base`: stripped to get the checkpoint's name.
_WRAPPERS = re.compile(r"(_checkpoint_wrapped_module|_orig_mod|_fsdp_wrapped_module)\.")
_LORA_BASE = re.compile(r"\.base\.(weight|bias)$")


def checkpoint_name(name: str) -> str:
    """`layers.0._checkpoint_wrapped_module.attention.wq.base.weight` ->
    `layers.0.attention.wq.weight`."""
    return _LORA_BASE.sub(r".\1", _WRAPPERS.sub("", name))


def _meta_names(backbone: Transformer) -> set[str]:
    """The backbone's parameters still on the meta device: the base's (those a method created,
    adapters and heads, are real already)."""
    return {n for n, p in backbone.named_parameters() if p.is_meta}


@torch.no_grad()
def materialize(model: nn.Module, backbone: Transformer, base: LoadedModel,
                device: torch.device, skip: Collection[str] = ()) -> LoadReport:
    """Fill `model` (built from `base` on the meta device, then sharded; `backbone` is the
    `Transformer` inside it) with the base's weights: each rank reads only the regions of each
    tensor it holds, cast to the parameter's dtype. Parameters created for real before sharding
    (adapters, heads) keep their values; those named in `skip` are left for the caller to fill
    (QLoRA's 4-bit codes and scales: `qlora_load`)."""
    with LoadTimer() as timer:
        from_checkpoint = _meta_names(backbone) - set(skip)
        kept = {n: local_region(p)[0].clone() for n, p in model.named_parameters()
                if not p.is_meta}
        model.to_empty(device=device)  # FSDP2 allocates each rank's shards only
        for n, p in model.named_parameters():
            if n in kept:
                local_region(p)[0].copy_(kept[n])
        del kept
        targets = {checkpoint_name(n): p for n, p in backbone.named_parameters()
                   if n in from_checkpoint}
        backbone.inv_freq = inverse_frequencies(base.args.head_dim, base.args.rope_theta,
                                                base.args.rope_scaling).to(device)
        backbone.reset_moe_state()
        directory = Path(base.directory)
        if (directory / CONFIG_NAME).is_file():
            with hf_slices(directory, base.args) as reader:
                fill_regions(targets, reader.read)
                nbytes = reader.bytes_read  # stored bytes taken from the files
        else:  # the persistent buffers too (MoE routing biases; HF files store none)
            persistent = set(backbone.state_dict())
            targets.update({checkpoint_name(n): b for n, b in backbone.named_buffers()
                            if n in persistent})
            # its hashes were checked when the base was described (`load_base`)
            load_native_regions(targets, directory, dist.is_initialized(), verify=False)
            nbytes = sum(local_region(p)[0].numel() * local_region(p)[0].element_size()
                         for p in targets.values())
    report = timer.report(nbytes)
    log.info("base loaded sharded in %.2f s: %.1f MiB of weights read by this rank, peak RSS "
             "%.1f MiB", report.seconds, report.bytes_read / 2**20,
             report.peak_rss_bytes / 2**20)
    return report


__all__ = ["materialize", "checkpoint_name"]
