"""Export any model directory, a fine-tune merged, as a Hugging Face checkpoint without holding
the model: tensors are read, merged and written one transformer block at a time, into
safetensors shards of at most `max_shard_bytes` (`models.hf_save`).

Sources: a Hugging Face directory (read by slice), a native checkpoint or a training run (read
tensor by tensor through DCP), or a `scaletrain finetune` output of task `sft`: LoRA/QLoRA
adapters merged into their full-precision base (`W + scaling * B @ A`, in fp32, then cast),
norms trained with the adapter taking the base's place; full/freeze runs from their latest
checkpoint. Peak host memory: one shard being written plus one block being made (the first block
carries the embeddings and the head), never the whole model.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from scaletrain.checkpoint.sharded_load import read_native_tensors
from scaletrain.finetune.base import FinetuneError
from scaletrain.finetune.base_pin import base_path, check_base
from scaletrain.finetune.format import ADAPTER_DIR
from scaletrain.finetune.lora import LoRALinear
from scaletrain.finetune.peft_io import load_adapter
from scaletrain.inference.finetuned import FINETUNE_META
from scaletrain.inference.loader import (
    LoadedModel,
    find_checkpoint,
    load_model,
    read_finetune_meta,
)
from scaletrain.models.args import ModelArgs
from scaletrain.models.hf import hf_slices, save_hf_stream
from scaletrain.models.hf_save import PlannedTensor
from scaletrain.models.hf_state_dict import to_hf_state_dict
from scaletrain.models.transformer import Transformer

log = logging.getLogger(__name__)

_LAYER = re.compile(r"layers\.(\d+)\.")
_HF_LAYER0 = re.compile(r"^(model\.layers|transformer\.h)\.0\.")
Reader = Callable[[dict[str, tuple[int, ...]]], dict[str, torch.Tensor]]
"""{our name: shape} -> {our name: fp32 tensor}, read from the source checkpoint."""


def _reader(kind: str, directory: Path, args: ModelArgs, verified: bool) -> Reader:
    """`verified`: the content hashes of native `directory` were checked already."""
    if kind == "hf":
        slices = hf_slices(directory, args)
        return lambda shapes: {n: slices.read(n, dtype=torch.float32) for n in shapes}
    from scaletrain.checkpoint.native_format import open_checkpoint

    open_checkpoint(directory, False if verified else None)  # checked once, not per block
    return lambda shapes: read_native_tensors(directory, shapes)


def _group_of(name: str) -> int:
    """Block index of our tensor `name`; embeddings, final norm and head go with block 0."""
    m = _LAYER.match(name)
    return int(m.group(1)) if m else 0


class _Merged:
    """Our tensors of one block at a time: the source's values, adapters merged."""

    def __init__(self, backbone: Transformer, names: dict[str, tuple[int, ...]], read: Reader,
                 dtype: torch.dtype) -> None:
        self.backbone, self.read, self.dtype = backbone, read, dtype
        self.args: ModelArgs = backbone.args
        self.groups: dict[int, dict[str, tuple[int, ...]]] = {}
        for name, shape in names.items():
            self.groups.setdefault(_group_of(name), {})[name] = shape
        self.lora = {n: m for n, m in backbone.named_modules() if isinstance(m, LoRALinear)}
        self.real = {_plain(n): p for n, p in backbone.named_parameters() if not p.is_meta
                     and ".lora_" not in n}
        self.one_block = dataclasses.replace(self.args, n_layers=1)

    def ours(self, group: int) -> dict[str, torch.Tensor]:
        shapes = self.groups[group]
        values = self.read({n: s for n, s in shapes.items() if n not in self.real})
        out = {}
        for name in shapes:
            value = self.real[name].detach().float() if name in self.real else values[name]
            module = self.lora.get(name.rpartition(".")[0])
            if module is not None and name.endswith(".weight"):
                value = value + module.delta_weight()
            out[name] = value.to(self.dtype)
        return out

    def hf(self, group: int, ours: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Block `group`'s tensors under their HF names (converted as block 0 of a one-block
        model, then renamed back)."""
        renamed = {_LAYER.sub("layers.0.", n, count=1) if _LAYER.match(n) else n: t
                   for n, t in ours.items()}
        hf = to_hf_state_dict(renamed, self.one_block)
        return {_HF_LAYER0.sub(rf"\g<1>.{group}.", k): v for k, v in hf.items()}

    def plan(self) -> list[PlannedTensor]:
        planned = []
        for group in sorted(self.groups):
            metas = {n: torch.empty(s, device="meta", dtype=self.dtype)
                     for n, s in self.groups[group].items()}
            for name, t in self.hf(group, metas).items():
                planned.append(PlannedTensor(name, tuple(t.shape), t.dtype, group))
        return planned

    def produce(self, group: Any) -> dict[str, torch.Tensor]:
        return self.hf(group, self.ours(group))


def _plain(name: str) -> str:
    return re.sub(r"\.base\.(weight|bias)$", r".\1", name)


def _prefill_small(backbone: Transformer, read: Reader) -> None:
    """Give the 1-D parameters (norms, biases) their source values before an adapter is loaded:
    norms the adapter trained then replace them (on the meta device they would be lost)."""
    small = {n: tuple(p.shape) for n, p in backbone.named_parameters() if p.ndim == 1}
    values = read(small)
    for name, value in values.items():
        parent, _, attr = name.rpartition(".")
        setattr(backbone.get_submodule(parent), attr, nn.Parameter(value, requires_grad=False))


def export_hf(src: str | os.PathLike, dst: str | os.PathLike, dtype: torch.dtype | None,
              max_shard_bytes: int | None,
              special_tokens: Callable[[Path | None], dict[str, str]] | None = None) -> Path:
    """Write model directory `src` (see the module docstring) as a HF checkpoint `dst`;
    `special_tokens(tokenizer.json path)` gives the strings written into a tokenizer config
    made for a bare tokenizer."""
    src = Path(src)
    meta: dict[str, Any] | None = None
    if (src / FINETUNE_META).is_file():
        meta = read_finetune_meta(src)
        if meta.get("task") != "sft":
            raise FinetuneError(f"{src} is a {meta.get('task')} fine-tune; only language "
                                "models (task sft) convert to a causal-LM checkpoint")
        base_dir = base_path(meta)
    else:
        base_dir = str(src)
    info: LoadedModel = load_model(base_dir, weights=False)  # tokenizer, eos, args
    args = info.args
    kind, directory = find_checkpoint(base_dir)
    if meta is not None:
        check_base(meta, info.directory, src / FINETUNE_META)
        if meta.get("method") not in ("lora", "qlora"):  # trained weights: the run's own
            kind, directory = "native", find_checkpoint(src)[1]
    read = _reader(kind, directory, args, verified=directory == info.directory)
    if dtype is None:
        dtype = torch.float32 if meta is not None or kind == "native" \
            else hf_slices(directory, args).stored_dtype()
    with torch.device("meta"):
        backbone = Transformer(args)
    names = {n: tuple(t.shape) for n, t in backbone.state_dict().items()
             if not (args.tie_embeddings and n == "output.weight")}  # written once, as HF does
    if meta is not None and meta.get("method") in ("lora", "qlora"):
        _prefill_small(backbone, read)
        load_adapter(src / ADAPTER_DIR, backbone)
    merged = _Merged(backbone, names, read, dtype)
    eos = list(info.stop_ids) if len(info.stop_ids) > 1 else info.eos_id
    out = save_hf_stream(dst, args, dtype, merged.plan(), merged.produce, max_shard_bytes,
                         eos_token_id=eos, tokenizer_file=info.tokenizer_path,
                         special_tokens=special_tokens(info.tokenizer_path) if special_tokens
                         else None)
    log.info("exported %s%s as Hugging Face weights, block by block", src,
             f" ({meta.get('method')} merged)" if meta else "")
    return out


__all__ = ["export_hf"]
