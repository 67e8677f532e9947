"""Read any region of any of our tensors straight from a Hugging Face checkpoint's safetensors
files (memory-mapped, by slice), without reading the rest of the checkpoint.

The region of our tensor a caller wants (a rank's shard: a range of rows for FSDP, of rows or
columns for tensor parallel) is translated into the region of the stored Hugging Face tensor it
comes from, and only that is read (`safe_open(...).get_slice(name)[...]`, what
`torch.distributed.checkpoint`'s Hugging Face reader does too).

The translation is not written out a second time: `from_hf_state_dict`
(`models/hf_state_dict.py`), the one converter, is run on meta tensors of the stored shapes, and
each tensor it returns is a view (a rename, a transpose, a split of a fused projection) of one
stored tensor; the view's offset and strides say which stored rows and columns each of our rows
and columns are. A tensor the
converter stacks (the experts of an MoE checkpoint, stored one tensor per expert) is recorded
while the converter runs (`torch.stack` seen through a `TorchFunctionMode`): a region over our
stacked dim 0 is a range of experts, and each of them is read by slice as above, the experts a
rank does not hold not at all. A tensor that is neither (transformers' fused in-memory
`gate_up_proj`, which the converter copies) is read whole, converted and sliced.

`HFSlices.bytes_read` counts the stored bytes the reads took from the files.

No distributed code: callers pass the region.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from scaletrain.models.hf_files import header_shapes, read_hf_weights, weight_files

logger = logging.getLogger(__name__)

Converter = Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]]
Region = tuple[slice, ...]
"""One contiguous range per dimension of our tensor (`slice(start, stop)`)."""

_ST_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16,
              "BF16": torch.bfloat16, "I64": torch.int64, "I32": torch.int32,
              "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool}


@dataclass(frozen=True)
class StoredView:
    """Our tensor as a view of stored tensor `name`: our dim i is stored dim `dims[i]`, and our
    index 0 along it is stored index `starts[i]`."""

    name: str
    dims: tuple[int, ...]
    starts: tuple[int, ...]

    def stored_region(self, region: Region, stored_ndim: int) -> tuple[slice, ...]:
        out = [slice(None)] * stored_ndim
        for ours, (dim, start) in enumerate(zip(self.dims, self.starts, strict=True)):
            r = region[ours]
            out[dim] = slice(start + r.start, start + r.stop)
        return tuple(out)


def _as_view(ours: torch.Tensor, stored: dict[int, tuple[str, torch.Tensor]]
             ) -> StoredView | None:
    """The `StoredView` of meta tensor `ours` over one of the `stored` meta tensors (by id), or
    None when it is not a plain strided view of one (a stacked or concatenated tensor)."""
    base = ours if id(ours) in stored else ours._base
    if base is None or id(base) not in stored:
        return None
    name, root = stored[id(base)]
    if ours.dim() != root.dim():
        return None
    offset = ours.storage_offset() - root.storage_offset()
    starts_by_dim = []
    for stride in root.stride():
        starts_by_dim.append(offset // stride if stride else 0)
        offset = offset % stride if stride else offset
    dims: list[int] = []
    for size, stride in zip(ours.shape, ours.stride(), strict=True):
        match = [d for d, s in enumerate(root.stride())
                 if s == stride and d not in dims and root.shape[d] >= size]
        if len(match) != 1 and size > 1:
            return None  # ambiguous (dims of size 1 share strides): read it whole
        if not match:
            return None
        dims.append(match[0])
    if sorted(dims) != list(range(root.dim())):
        return None
    return StoredView(name, tuple(dims), tuple(starts_by_dim[d] for d in dims))


@dataclass(frozen=True)
class StackedView:
    """Our tensor as `torch.stack(parts)`: index e of our dim 0 is stored view `parts[e]`."""

    parts: tuple[StoredView, ...]


class _StackRecorder(TorchFunctionMode):
    """Records, while the converter runs on meta tensors, each `torch.stack(tensors, dim=0)`:
    id(result) -> (result, tensors) (the result kept so that its id stays its own)."""

    def __init__(self) -> None:
        super().__init__()
        self.stacks: dict[int, tuple[torch.Tensor, list[torch.Tensor]]] = {}

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func is torch.stack:
            tensors = args[0] if args else kwargs["tensors"]
            dim = args[1] if len(args) > 1 else kwargs.get("dim", 0)
            if dim == 0 and isinstance(out, torch.Tensor):
                self.stacks[id(out)] = (out, list(tensors))
        return out


def _as_stack(ours: torch.Tensor, stacks: dict[int, tuple[torch.Tensor, list[torch.Tensor]]],
              stored: dict[int, tuple[str, torch.Tensor]]) -> StackedView | None:
    """The `StackedView` of meta tensor `ours` when the converter stacked it from views of
    stored tensors, else None."""
    record = stacks.get(id(ours))
    if record is None or record[0] is not ours:
        return None
    parts = [_as_view(t, stored) for t in record[1]]
    if not parts or any(v is None for v in parts):
        return None
    return StackedView(tuple(parts))  # type: ignore[arg-type]


class HFSlices:
    """Regions of our (scaletrain-named) tensors from a HF checkpoint directory; a context
    manager (closing it drops what the fallback converted).

    `shapes[name]` is our tensor's full shape; `read(name, region, dtype)` returns that region,
    cast to `dtype`, reading only the stored bytes it covers (except for tensors that are not a
    view of one stored tensor, see the module docstring).
    """

    def __init__(self, directory: str | os.PathLike, convert: Converter,
                 ignored: re.Pattern[str] | None = None) -> None:
        """`convert`: HF state dict -> ours (`models.hf_state_dict.from_hf_state_dict` for the
        model's args); `ignored`: stored names that hold no weights."""
        self.directory = Path(directory)
        self._convert = convert
        self._file_of: dict[str, Path] = {}
        stored_shapes: dict[str, tuple[int, ...]] = {}
        for path in weight_files(self.directory):
            shapes = header_shapes([path])
            stored_shapes.update(shapes)
            self._file_of.update(dict.fromkeys(shapes, path))
        metas = {k: torch.empty(s, device="meta") for k, s in stored_shapes.items()
                 if ignored is None or not ignored.search(k)}
        by_id = {id(t): (k, t) for k, t in metas.items()}
        with _StackRecorder() as recorder:
            ours = convert(metas)
        self.shapes: dict[str, tuple[int, ...]] = {k: tuple(t.shape) for k, t in ours.items()}
        self.views: dict[str, StoredView | StackedView | None] = {
            k: _as_view(t, by_id) or _as_stack(t, recorder.stacks, by_id)
            for k, t in ours.items()}
        self._converted: dict[str, torch.Tensor] | None = None
        self.bytes_read = 0
        """Stored bytes read from the files so far (the whole checkpoint for a fallback)."""

    def __enter__(self) -> HFSlices:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._converted = None

    @contextlib.contextmanager
    def _stored(self, name: str) -> Iterator[Any]:
        """The stored tensor `name`'s slice handle. Its file is mapped only while the block
        runs: mapped pages a read touched count in the process's resident memory until the
        file is unmapped, so a file left open would hold a rank's share of it twice."""
        from safetensors import safe_open

        with safe_open(str(self._file_of[name]), framework="pt") as f:
            yield f.get_slice(name)

    def stored_dtype(self) -> torch.dtype:
        """The dtype of the first floating-point stored tensor (float32 when none)."""
        for name in self._file_of:
            with self._stored(name) as stored:
                code = stored.get_dtype()
            dtype = _ST_DTYPES.get(code)
            if dtype is not None and dtype.is_floating_point:
                return dtype
        return torch.float32

    def full_region(self, name: str) -> Region:
        return tuple(slice(0, n) for n in self.shapes[name])

    def read(self, name: str, region: Region | None = None,
             dtype: torch.dtype | None = None) -> torch.Tensor:
        """Region `region` (all of it when None) of our tensor `name`, cast to `dtype`."""
        if name not in self.shapes:
            raise KeyError(f"{self.directory} holds no tensor for {name}")
        region = self.full_region(name) if region is None else region
        view = self.views[name]
        if isinstance(view, StackedView):
            return self._read_stacked(view, region, dtype)
        tensor = self._whole(name)[region] if view is None else self._read_view(view, region)
        if dtype is not None and tensor.dtype != dtype:
            tensor = tensor.to(dtype)
        return tensor.contiguous()

    def _read_view(self, view: StoredView, region: Region) -> torch.Tensor:
        """Region `region` of our tensor that is stored view `view`, in the stored dtype."""
        with self._stored(view.name) as stored:
            ndim = len(stored.get_shape())
            part = stored[view.stored_region(region, ndim)]
        self.bytes_read += part.numel() * part.element_size()
        # `part` has the stored dims in stored order; our dim i is stored dim dims[i]
        return part.permute(*view.dims) if view.dims != tuple(range(ndim)) else part

    def _read_stacked(self, view: StackedView, region: Region,
                      dtype: torch.dtype | None) -> torch.Tensor:
        """Region `region` of a stacked tensor: only the parts its dim-0 range covers, each
        read by slice into its row of the result."""
        first, rest = region[0], region[1:]
        pieces = range(first.start, first.stop)
        out: torch.Tensor | None = None
        for i, e in enumerate(pieces):
            piece = self._read_view(view.parts[e], rest)
            if out is None:
                out = torch.empty((len(pieces), *piece.shape), dtype=dtype or piece.dtype)
            out[i].copy_(piece)
            del piece
        if out is None:  # an empty range of experts
            shape = tuple(r.stop - r.start for r in rest)
            out = torch.empty((0, *shape), dtype=dtype or torch.float32)
        return out

    def _whole(self, name: str) -> torch.Tensor:
        """Fallback for tensors that are not a view of one stored tensor: the whole checkpoint
        converted once (kept until `close`)."""
        if self._converted is None:
            logger.warning("%s: %s is not a slice of one stored tensor; reading the whole "
                           "checkpoint to convert it", self.directory, name)
            stored = read_hf_weights(self.directory)
            self.bytes_read += sum(t.numel() * t.element_size() for t in stored.values())
            self._converted = self._convert(stored)
        return self._converted[name]


__all__ = ["HFSlices", "StoredView", "StackedView", "Region", "Converter"]
