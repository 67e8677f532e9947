"""Fill a model built on the meta device (and possibly already sharded: FSDP2 dim-0 shards,
tensor-parallel row/column shards, both) with the weights of a checkpoint, each rank reading
only the part of each tensor it owns.

- Hugging Face safetensors: through `models.hf_slices.HFSlices` (memory-mapped, by slice;
  each region cast on the way).
- Native checkpoints (DCP): `torch.distributed.checkpoint` loads a state dict of DTensors by
  reading, per rank, the stored chunks that overlap its shards; a chunk stored whole (a
  checkpoint saved by one process) is read whole and cut, so the transient is one tensor.

A rank's region of a tensor is the one `DTensor.__create_chunk_list__` reports (the chunk DCP
saves for it), so the placements FSDP2 and tensor parallel produce are all covered. Peak host
memory per rank: its shards (about the model / N) plus one tensor region in flight, at most
`READ_BLOCK_BYTES` of dim-0 rows (and that block in the stored dtype).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.distributed.tensor import DTensor

from scaletrain.host import peak_rss_bytes
from scaletrain.models.hf_slices import Region

logger = logging.getLogger(__name__)

ReadRegion = Callable[[str, Region, torch.dtype], torch.Tensor]
"""(checkpoint name, region of the full tensor, dtype) -> that region's values."""

READ_BLOCK_BYTES = 256 * 2**20
"""A region larger than this (in its parameter's dtype) is read in blocks of dim-0 rows of at
most this size, so the tensor in flight stays small (a 128K x 8,192 embedding is 4 GiB in
fp32, 6 GiB with its bf16 read)."""


def block_rows(shape: tuple[int, ...], element_size: int, limit: int | None = None) -> int:
    """Dim-0 rows of a tensor of `shape` read at a time (at least one; `limit` bytes, default
    READ_BLOCK_BYTES)."""
    limit = READ_BLOCK_BYTES if limit is None else limit
    row = element_size
    for n in shape[1:]:
        row *= n
    return max(1, limit // max(row, 1))


def local_region(tensor: torch.Tensor) -> tuple[torch.Tensor, Region]:
    """(this rank's local tensor, the region of the full tensor it holds). A plain tensor holds
    all of itself."""
    if not isinstance(tensor, DTensor):
        return tensor, tuple(slice(0, n) for n in tensor.shape)
    local = tensor.to_local()
    chunks = tensor.__create_chunk_list__()
    if len(chunks) != 1 or tuple(chunks[0].sizes) != tuple(local.shape):
        raise ValueError(f"cannot name one region for a DTensor with placements "
                         f"{tensor.placements} (chunks {chunks}, local shape "
                         f"{tuple(local.shape)})")
    chunk = chunks[0]
    return local, tuple(slice(o, o + s) for o, s in zip(chunk.offsets, chunk.sizes, strict=True))


@torch.no_grad()
def fill_regions(targets: Mapping[str, torch.Tensor], read: ReadRegion) -> int:
    """Copy into each target (checkpoint name -> parameter, plain or DTensor, materialized) the
    region of the stored tensor this rank holds. Returns the bytes this rank read."""
    done: set[int] = set()
    nbytes = 0
    for name, target in targets.items():
        if id(target) in done:
            continue  # tied weights: one parameter under two names
        done.add(id(target))
        local, region = local_region(target)
        if local.numel() == 0:
            continue  # an FSDP rank past the end of a short dim 0
        if local.dim() == 0:
            _copy_region(name, local, region, read)
        else:
            rows = block_rows(tuple(local.shape), local.element_size())
            first = region[0]
            for start in range(0, local.shape[0], rows):
                stop = min(start + rows, local.shape[0])
                part = (slice(first.start + start, first.start + stop), *region[1:])
                _copy_region(name, local[start:stop], part, read)
        nbytes += local.numel() * local.element_size()
    return nbytes


def _copy_region(name: str, local: torch.Tensor, region: Region, read: ReadRegion) -> None:
    values = read(name, region, local.dtype)
    if tuple(values.shape) != tuple(local.shape):
        raise ValueError(f"{name}: read a region of shape {tuple(values.shape)} for a local "
                         f"shard of shape {tuple(local.shape)}")
    local.copy_(values)


def load_native_regions(targets: Mapping[str, torch.Tensor], directory: str | os.PathLike,
                        distributed: bool, verify: bool | None = None) -> None:
    """Fill `targets` (our names -> parameters, plain or DTensor) from native checkpoint
    `directory`'s "model" entry (verified, restricted unpickling: `checkpoint.safe_dcp`;
    `verify=False` skips the content hashes a caller already checked)."""
    from scaletrain.checkpoint.native_format import check_finite, open_checkpoint
    from scaletrain.checkpoint.safe_dcp import load_dcp

    open_checkpoint(directory, verify)
    state: dict[str, dict[str, torch.Tensor]] = {"model": {}}
    seen: set[int] = set()
    for name, tensor in targets.items():
        if id(tensor) not in seen:  # DCP writes a tied weight under one name
            seen.add(id(tensor))
            state["model"][name] = tensor.detach()
    load_dcp(state, Path(directory), no_dist=not distributed)
    check_finite({k: local_region(v)[0] for k, v in state["model"].items()}, directory)


def read_native_tensors(directory: str | os.PathLike, shapes: Mapping[str, tuple[int, ...]],
                        dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """Whole tensors `shapes` (our names) of native checkpoint `directory`'s "model" entry, in
    `dtype`, in one process; only those are read. The caller checked the checkpoint first
    (`native_format.open_checkpoint`)."""
    from scaletrain.checkpoint.native_format import check_finite
    from scaletrain.checkpoint.safe_dcp import load_dcp

    state = {"model": {n: torch.empty(s, dtype=dtype) for n, s in shapes.items()}}
    if state["model"]:
        load_dcp(state, Path(directory), no_dist=True)
        check_finite(state, directory)
    return state["model"]


@dataclass
class LoadReport:
    """What one rank's load cost: wall seconds, bytes of weights it read (from a Hugging Face
    base: the stored bytes taken from its files; from a native one: its regions' bytes), its
    peak RSS."""

    seconds: float
    bytes_read: int
    peak_rss_bytes: int

    def as_dict(self) -> dict[str, float | int]:
        return {"seconds": round(self.seconds, 3), "bytes_read": self.bytes_read,
                "peak_rss_bytes": self.peak_rss_bytes}


class LoadTimer:
    """`with LoadTimer() as t: ...`; then `t.report(bytes_read)`."""

    def __enter__(self) -> LoadTimer:
        self.start = time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        self.seconds = time.perf_counter() - self.start

    def report(self, bytes_read: int) -> LoadReport:
        return LoadReport(self.seconds, bytes_read, peak_rss_bytes())


__all__ = ["local_region", "fill_regions", "block_rows", "READ_BLOCK_BYTES",
           "load_native_regions", "read_native_tensors",
           "LoadReport", "LoadTimer",
           "ReadRegion"]
