"""Host memory per rank while a fine-tuning run loads its base (`plan --method`): what
`finetune.base_sharded` and the whole-base loader hold at their peak.

- FSDP (ZeRO-2/3 over N ranks) and/or tensor parallelism (T ranks), LoRA/full/freeze: each
  rank holds its shards of the base in fp32 (about base / (N x T)) plus one tensor region in
  flight, read in the stored dtype and cast: at most the largest tensor in both dtypes.
- One process, DDP without TP, and QLoRA (which reads the fp32 base on the host, then
  quantizes it): the whole base in fp32 on every process, plus the largest tensor in flight.
Measured against this bound: `bench/finetune_load_cpu.py`, `tests/distributed/
test_sharded_load.py`.
"""

from __future__ import annotations

import torch

from scaletrain.models.args import ModelArgs

LOAD_BYTES = 4  # the trainer loads the base in fp32 (FSDP's mixed precision casts on gather)


def tensor_sizes(args: ModelArgs) -> list[int]:
    """Element counts of the model's parameters (a tied head counted once), from a model
    built on the meta device."""
    from scaletrain.models.transformer import Transformer

    with torch.device("meta"):
        model = Transformer(args)
    return [p.numel() for p in model.parameters()]


def host_load_bytes(args: ModelArgs, method: str, shards: int, stored_bytes: int = 2
                    ) -> dict[str, int | bool]:
    """Per-rank host bytes of the base's load: `weights` (the rank's shards, or the whole base),
    `in_flight` (the largest tensor, read in `stored_bytes` per element and cast to fp32) and
    `peak`; `sharded` says which loader runs."""
    sizes = tensor_sizes(args)
    sharded = shards > 1 and method != "qlora"
    total = sum(sizes) * LOAD_BYTES
    weights = -(-total // shards) if sharded else total
    in_flight = max(sizes) * (stored_bytes + LOAD_BYTES)
    return {"sharded": sharded, "weights": weights, "in_flight": in_flight,
            "peak": weights + in_flight}


__all__ = ["host_load_bytes", "tensor_sizes", "LOAD_BYTES"]
