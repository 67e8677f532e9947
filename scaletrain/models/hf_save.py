"""Hugging Face safetensors weights written shard by shard, as transformers writes them:
`model.safetensors`, or `model-0000K-of-0000N.safetensors` files of at most `max_shard_bytes`
each (a tensor larger than that gets a shard of its own) with `model.safetensors.index.json`
(`metadata.total_size`, `weight_map`).

The tensors are planned from their names, shapes and dtypes before any is made, then produced
one group at a time (`produce(group)` -> that group's tensors): only the shard being written
and the group being produced are in memory, never the whole model. A group is what is cheapest
to make together (a transformer block: its tensors read and, for a fine-tune, merged at once).
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from scaletrain.models.hf_files import INDEX_NAME, WEIGHTS_NAME


@dataclass(frozen=True)
class PlannedTensor:
    name: str
    """The tensor's name in the written files (HF's)."""
    shape: tuple[int, ...]
    dtype: torch.dtype
    group: Hashable
    """What `produce` is called with to make it (and the rest of its group)."""

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * torch.empty((), dtype=self.dtype).element_size()


def plan_shards(tensors: Sequence[PlannedTensor], max_shard_bytes: int | None
                ) -> list[list[PlannedTensor]]:
    """Consecutive runs of `tensors` of at most `max_shard_bytes` each (one shard when None)."""
    if max_shard_bytes is None:
        return [list(tensors)]
    shards: list[list[PlannedTensor]] = [[]]
    size = 0
    for t in tensors:
        if shards[-1] and size + t.nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(t)
        size += t.nbytes
    return shards


def shard_names(count: int) -> list[str]:
    """transformers' file names for `count` shards."""
    if count == 1:
        return [WEIGHTS_NAME]
    width = max(5, int(math.log10(count)) + 1)
    return [f"model-{n:0{width}d}-of-{count:0{width}d}.safetensors"
            for n in range(1, count + 1)]


def write_shards(folder: Path, tensors: Sequence[PlannedTensor],
                 produce: Callable[[Hashable], dict[str, torch.Tensor]],
                 max_shard_bytes: int | None) -> int:
    """Write `tensors` into `folder` as safetensors shards (+ the index when several), making
    each group with `produce` when its first tensor is due. Groups should be contiguous in
    `tensors` (each is then produced once). Returns the number of files."""
    from safetensors.torch import save_file

    shards = plan_shards(tensors, max_shard_bytes)
    names = shard_names(len(shards))
    group: Hashable = object()
    made: dict[str, torch.Tensor] = {}
    weight_map: dict[str, str] = {}
    for file_name, shard in zip(names, shards, strict=True):
        out: dict[str, torch.Tensor] = {}
        for t in shard:
            if t.name not in made or t.group != group:
                group, made = t.group, produce(t.group)
            value = made[t.name]
            if tuple(value.shape) != t.shape or value.dtype != t.dtype:
                raise ValueError(f"{t.name}: produced {tuple(value.shape)} {value.dtype}, "
                                 f"planned {t.shape} {t.dtype}")
            out[t.name] = value.contiguous()
        save_file(out, folder / file_name, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(out, file_name))
        del out
    if len(shards) > 1:
        total = sum(t.nbytes for t in tensors)
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (folder / INDEX_NAME).write_text(json.dumps(index, indent=2) + "\n")
    return len(shards)


__all__ = ["PlannedTensor", "plan_shards", "shard_names", "write_shards"]
