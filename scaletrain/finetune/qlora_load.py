"""QLoRA's base read one layer at a time, quantized on the way, each rank keeping only what it
holds: no process ever holds the fp32 base.

The model is built on the meta device and every block linear becomes an empty `NF4Linear`
(`empty_nf4`: the parameter sizes bitsandbytes' quantization gives, `qlora_shard.py`). After
the layout is applied (FSDP2 shards each `uint8` parameter along dim 0; DDP keeps them whole),
`materialize_qlora` fills the model: the parameters that are not quantized (embeddings, norms,
the output head, biases) by the region reads of `base_sharded.materialize`, and each NF4 layer
by reading its fp32 weight whole (one tensor at a time), quantizing it as one QLoRA process
does (`qlora.to_nf4`: bitsandbytes NF4 with double quantization, on the CPU; the nested
scales' offset is a mean over the whole layer, so a shard cannot be quantized alone) and
copying into each parameter the region this rank holds (`checkpoint.sharded_load.
local_region`). The bytes are those of one process's quantization, and the peak host memory
of a rank is its part of the stored base (block linears at ~0.52 byte per weight, the rest in
fp32) plus one whole weight in flight (`plan/finetune/host.py` states it).

Under torchrun the ranks share the work: layer i is read and quantized by rank i % N and
broadcast whole (0.52 byte per weight) to the others, each keeping its region; so each rank
reads and quantizes 1/N of the block weights.

One process loads the same way (`bitsandbytes=True`), before the adapters are made: the meta
model's block linears become empty NF4 layers, are filled one at a time, and are then handed
back as the bitsandbytes `Linear4bit` layers one QLoRA process has always trained
(`qlora_shard.to_bitsandbytes`, over the same bytes); its peak host memory is the 4-bit base
(plus the rest in fp32) and one weight in flight, not the fp32 base.
"""

from __future__ import annotations

import copy
import functools
import logging
from collections.abc import Callable, Mapping
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from scaletrain.checkpoint.sharded_load import (
    LoadReport,
    LoadTimer,
    local_region,
    read_native_tensors,
)
from scaletrain.finetune.base_sharded import checkpoint_name, materialize
from scaletrain.finetune.qlora import BLOCK_SIZE, check_cpu_rows, to_nf4
from scaletrain.finetune.qlora_shard import NF4Linear, bitsandbytes_nf4
from scaletrain.inference.loader import LoadedModel

log = logging.getLogger(__name__)

PARTS = ("weight", "absmax", "nested_absmax", "offset")
"""The `uint8` parameters of an `NF4Linear` (the packed codes, then the scales)."""
_SETTINGS = ("in_features", "out_features", "shape", "dtype", "blocksize", "quant_type",
             "nested_blocksize", "nested_dtype", "compute_dtype")

ReadWhole = Callable[[str, tuple[int, ...]], torch.Tensor]
"""(checkpoint name, shape) -> the whole stored tensor in fp32."""


@functools.lru_cache(maxsize=4)
def _reference(compute_dtype: torch.dtype) -> NF4Linear:
    """A one-block NF4 layer quantized for real: the settings and code books every layer
    shares."""
    with torch.device("cpu"):  # also when called under a meta device context
        linear = nn.Linear(BLOCK_SIZE, 1, bias=False)
        nn.init.ones_(linear.weight)
        return NF4Linear(to_nf4(linear, compute_dtype))


def nf4_sizes(numel: int, nested_blocksize: int) -> dict[str, int]:
    """Bytes of each `NF4Linear` parameter for a weight of `numel` elements: two 4-bit codes
    per byte, an 8-bit scale per block of `BLOCK_SIZE`, an fp32 scale per `nested_blocksize`
    scales, and the fp32 offset."""
    blocks = -(-numel // BLOCK_SIZE)
    return {"weight": (numel + 1) // 2, "absmax": blocks,
            "nested_absmax": 4 * -(-blocks // nested_blocksize), "offset": 4}


def empty_nf4(linear: nn.Linear, compute_dtype: torch.dtype) -> NF4Linear:
    """An `NF4Linear` on the meta device for `linear` (meta too), of the sizes and settings
    its quantization will have; `fill_nf4` fills it."""
    check_cpu_rows(linear.in_features)  # quantized on the CPU, as one process does
    layer = copy.deepcopy(_reference(compute_dtype))
    layer.in_features, layer.out_features = linear.in_features, linear.out_features
    layer.shape = (linear.out_features, linear.in_features)
    for part, size in nf4_sizes(linear.weight.numel(), layer.nested_blocksize).items():
        setattr(layer, part, nn.Parameter(torch.empty(size, dtype=torch.uint8, device="meta"),
                                          requires_grad=False))
    layer.bias = None if linear.bias is None else nn.Parameter(
        torch.empty_like(linear.bias, device="meta"), requires_grad=False)
    for name in ("code", "nested_code"):  # written again by `fill_nf4` after `to_empty`
        setattr(layer, name, torch.empty_like(getattr(layer, name), device="meta"))
    return layer


def nf4_layers(backbone: nn.Module) -> dict[str, NF4Linear]:
    """The checkpoint name of each NF4 layer's weight -> the layer (`layers.0.attention.wq.
    weight`, also for a layer inside a LoRA layer or an activation-checkpoint wrapper)."""
    return {checkpoint_name(f"{name}.weight"): m for name, m in backbone.named_modules()
            if isinstance(m, NF4Linear)}


def nf4_parameter_names(backbone: nn.Module) -> set[str]:
    """The names (`backbone.named_parameters()`) of the NF4 layers' codes and scales."""
    return {f"{name}.{part}" for name, m in backbone.named_modules()
            if isinstance(m, NF4Linear) for part in PARTS}


def _quantize(name: str, layer: NF4Linear, read_whole: ReadWhole) -> NF4Linear:
    """`layer`'s stored weight read whole (fp32) and quantized as one process does, checked
    against the sizes and settings the empty layer was built with."""
    weight = read_whole(name, tuple(layer.shape))
    linear = nn.Linear(layer.in_features, layer.out_features, bias=False, device="meta")
    linear.weight = nn.Parameter(weight, requires_grad=False)
    whole = NF4Linear(to_nf4(linear, layer.compute_dtype))
    for setting in _SETTINGS:
        if getattr(whole, setting) != getattr(layer, setting):
            raise RuntimeError(f"{name}: the quantized layer's {setting} is "
                               f"{getattr(whole, setting)}, the empty layer was built with "
                               f"{getattr(layer, setting)}")
    for part in PARTS:
        got, expected = getattr(whole, part).shape, getattr(layer, part).shape
        if tuple(got) != tuple(expected):
            raise RuntimeError(f"{name}: {part} of {tuple(got)} bytes quantized for a "
                               f"parameter of {tuple(expected)}")
    return whole


def _wire_device(group: dist.ProcessGroup | None) -> torch.device:
    """Where broadcast buffers live: the GPU under NCCL, else the CPU."""
    if group is not None and "nccl" in str(dist.get_backend(group)).lower():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


@torch.no_grad()
def fill_nf4(layers: Mapping[str, NF4Linear], read_whole: ReadWhole,
             group: dist.ProcessGroup | None = None) -> int:
    """Quantize each layer's stored weight (read whole, fp32) as one process does and copy
    into each of its parameters (plain or DTensor, materialized) the region this rank holds;
    also its code books. With `group` (every rank of which fills the same layers), layer i is
    read and quantized by rank i % size of the group only and broadcast. Returns the bytes
    kept."""
    size = dist.get_world_size(group) if group is not None else 1
    rank = dist.get_rank(group) if group is not None else 0
    wire = _wire_device(group)
    kept = 0
    for i, (name, layer) in enumerate(layers.items()):
        owner = i % size
        whole = _quantize(name, layer, read_whole) if owner == rank else None
        for part in (*PARTS, "code", "nested_code"):
            target = getattr(layer, part)
            if whole is not None:
                values = getattr(whole, part).to(wire)
            else:
                values = torch.empty(target.shape, dtype=target.dtype, device=wire)
            if size > 1:
                dist.broadcast(values, group=group, group_src=owner)
            if part in PARTS:
                local, region = local_region(target)
                local.copy_(values[region])
                kept += local.numel()
            else:  # a buffer, the same on every rank
                target.copy_(values)
            del values
        del whole
    return kept


@torch.no_grad()
def materialize_qlora(model: nn.Module, backbone: nn.Module, base: LoadedModel,
                      device: torch.device, bitsandbytes: bool = False) -> LoadReport:
    """Fill `model` (built from `base` on the meta device with empty NF4 layers, then given its
    layout; `backbone` is the `Transformer` inside it): the other parameters by region reads
    (`base_sharded.materialize`), the NF4 layers quantized one at a time (module docstring).
    `bitsandbytes` (one process, no layout): the filled layers are then made bitsandbytes
    `Linear4bit` layers."""
    from scaletrain.models.hf import CONFIG_NAME, hf_slices

    with LoadTimer() as timer:
        layers = nf4_layers(backbone)
        group = dist.group.WORLD if dist.is_initialized() and dist.get_world_size() > 1 \
            else None
        dense = materialize(model, backbone, base, device, skip=nf4_parameter_names(backbone))
        directory = Path(base.directory)
        if (directory / CONFIG_NAME).is_file():
            with hf_slices(directory, base.args) as reader:
                kept = fill_nf4(layers, lambda name, _shape: reader.read(name, None,
                                                                          torch.float32), group)
                quantized_read = reader.bytes_read  # stored bytes, as `materialize` counts
        else:  # checked when the base was described (`load_base`)
            native_read = 0

            def read_native(name: str, shape: tuple[int, ...]) -> torch.Tensor:
                nonlocal native_read
                tensor = read_native_tensors(directory, {name: shape})[name]
                native_read += tensor.numel() * tensor.element_size()
                return tensor

            kept = fill_nf4(layers, read_native, group)
            quantized_read = native_read
        if bitsandbytes:
            bitsandbytes_nf4(model)
    report = timer.report(dense.bytes_read + quantized_read)
    rank, size = (dist.get_rank(), dist.get_world_size()) if group else (0, 1)
    log.info("QLoRA base loaded in %.2f s: %d layers quantized one at a time (%d by this "
             "rank), %.1f MiB read and %.1f MiB of 4-bit layers kept by this rank, peak RSS "
             "%.1f MiB", report.seconds, len(layers), len(range(rank, len(layers), size)),
             report.bytes_read / 2**20, kept / 2**20, report.peak_rss_bytes / 2**20)
    return report


__all__ = ["empty_nf4", "fill_nf4", "materialize_qlora", "nf4_layers", "nf4_parameter_names",
           "nf4_sizes", "PARTS"]
