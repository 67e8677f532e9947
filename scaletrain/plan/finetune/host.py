"""Host memory per rank while a fine-tuning run loads its base (`plan --method`): what
`finetune.base_sharded`, `finetune.qlora_load` and the whole-base loader hold at their peak.

- FSDP (ZeRO-2/3 over N ranks) and/or tensor parallelism (T ranks), LoRA/full/freeze: each
  rank holds its shards of the base in fp32 (about base / (N x T)) plus one tensor region in
  flight, read in the stored dtype and cast: at most `READ_BLOCK_BYTES` (256 MiB) of one
  tensor's rows in both dtypes (an upper bound: the whole region's rows, not the rank's). LoRA
  with `precision.param_dtype bf16` keeps its (frozen) shards in bf16 (`param_bytes` 2); the
  frozen parts of `freeze` are bf16 too, counted at 4 bytes here (an upper bound).
- QLoRA (FSDP over N ranks; DDP and one process: N = 1): each rank holds its shards of the
  quantized base (block linears as NF4 codes and scales, ~0.52 byte per weight; the rest in
  fp32), plus one whole block weight in flight (read in the stored dtype, cast to fp32 and
  quantized) or one block of rows of another tensor (the embedding: 256 MiB, not 6 GiB).
- One process and DDP without TP (LoRA/full/freeze): the whole base in fp32, plus the largest
  tensor in flight.
Measured against this bound: `bench/finetune_load_cpu.py`, `bench/qlora_load_cpu.py`,
`tests/finetune/distributed/test_sharded_load.py`, `tests/finetune/distributed/test_qlora_load.py`,
`tests/finetune/test_qlora_load.py` (one process).
"""

from __future__ import annotations

import math

import torch

from scaletrain.checkpoint.sharded_load import block_rows
from scaletrain.models.args import ModelArgs

Shape = tuple[int, ...]

LOAD_BYTES = 4  # the trainer loads the base in fp32 (FSDP's mixed precision casts on gather)
NF4_BLOCK = 64  # weights per 8-bit scale (`finetune.qlora.BLOCK_SIZE`)
NF4_NESTED_BLOCK = 256  # 8-bit scales per fp32 scale of the double quantization


def tensor_sizes(args: ModelArgs) -> list[int]:
    """Element counts of the model's parameters (a tied head counted once), from a model
    built on the meta device."""
    quantized, other = split_sizes(args)
    return quantized + other


def split_shapes(args: ModelArgs) -> tuple[list[Shape], list[Shape]]:
    """(shapes of the weights QLoRA stores as NF4: every plain linear inside the blocks but
    MoE routers, as `finetune.qlora.quantize_blocks` picks them; of the other parameters, a
    tied head counted once)."""
    from torch import nn

    from scaletrain.models.transformer import Transformer

    with torch.device("meta"):
        model = Transformer(args)
    picked = {id(m.weight) for block in model.layers.values()
              for name, m in block.named_modules()
              if type(m) is nn.Linear and not name.endswith("router.gate")}
    quantized: list[Shape] = []
    other: list[Shape] = []
    for p in model.parameters():
        (quantized if id(p) in picked else other).append(tuple(p.shape))
    return quantized, other


def split_sizes(args: ModelArgs) -> tuple[list[int], list[int]]:
    """The element counts of `split_shapes`."""
    return tuple([math.prod(s) for s in part] for part in split_shapes(args))  # type: ignore


def region_in_flight(shapes: list[Shape], stored_bytes: int, kept_bytes: int) -> int:
    """Bytes of the largest region read at once (`checkpoint.sharded_load.fill_regions`:
    blocks of dim-0 rows of at most READ_BLOCK_BYTES in the kept dtype), held in the stored
    dtype and the kept one."""
    most = 0
    for shape in shapes:
        rows = min(shape[0], block_rows(shape, kept_bytes)) if shape else 1
        most = max(most, rows * math.prod(shape[1:]))
    return most * (stored_bytes + kept_bytes)


def nf4_bytes(numel: int) -> int:
    """Bytes of one weight of `numel` elements as NF4 with double quantization: packed codes,
    8-bit block scales, fp32 scales of the scales and their offset (`finetune.qlora_load`)."""
    blocks = -(-numel // NF4_BLOCK)
    return (numel + 1) // 2 + blocks + 4 * -(-blocks // NF4_NESTED_BLOCK) + 4


def host_load_bytes(args: ModelArgs, method: str, shards: int, stored_bytes: int = 2,
                    param_bytes: int = LOAD_BYTES) -> dict[str, int | bool]:
    """Per-rank host bytes of the base's load: `weights` (the rank's shards in `param_bytes`
    per element, or the whole base in fp32),
    `in_flight` (the largest read at once, in `stored_bytes` per element and cast: a whole
    tensor on the whole-base path, a block of rows of a region on the sharded path, a whole
    block linear for QLoRA, which quantizes it) and `peak`; `sharded` says whether each rank
    holds 1/shards and `quantized_on_load` whether the base is quantized as it is read (QLoRA,
    on any number of processes)."""
    quantized_shapes, other_shapes = split_shapes(args)
    quantized = [math.prod(q) for q in quantized_shapes]
    streamed = method == "qlora"
    sharded = shards > 1
    cast = stored_bytes + LOAD_BYTES
    if streamed:
        n = max(shards, 1)
        other = [math.prod(o) for o in other_shapes]
        weights = sum(-(-nf4_bytes(q) // n) for q in quantized) + \
            sum(-(-o * LOAD_BYTES // n) for o in other)
        in_flight = max(max(quantized, default=0) * cast + nf4_bytes(max(quantized, default=0)),
                        region_in_flight(other_shapes, stored_bytes, LOAD_BYTES))
    else:
        shapes = quantized_shapes + other_shapes
        sizes = [math.prod(s) for s in shapes]
        kept = param_bytes if sharded else LOAD_BYTES
        weights = -(-sum(sizes) * kept // shards) if sharded else sum(sizes) * kept
        in_flight = (region_in_flight(shapes, stored_bytes, kept) if sharded
                     else max(sizes) * (stored_bytes + kept))
    return {"sharded": sharded, "quantized_on_load": streamed, "weights": weights,
            "in_flight": in_flight, "peak": weights + in_flight,
            "base_dtype": "bf16" if sharded and not streamed and param_bytes == 2 else "fp32"}


__all__ = ["host_load_bytes", "tensor_sizes", "split_sizes", "split_shapes", "region_in_flight",
           "nf4_bytes", "LOAD_BYTES"]
