"""Load a fine-tuning run's result for inference: base + adapter (merged) or the trained weights
of the latest checkpoint; used by `predict`, `generate` and `convert`."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from scaletrain.finetune.base import BaseModel, FinetuneError, load_base
from scaletrain.finetune.base_pin import base_path, check_base
from scaletrain.finetune.heads import SequenceClassifier
from scaletrain.finetune.trainer import ADAPTER_DIR, META_NAME, read_meta
from scaletrain.models.args import ModelArgs

log = logging.getLogger("scaletrain.finetune")


@dataclass
class Finetuned:
    model: nn.Module
    """A `Transformer` (SFT) or a `SequenceClassifier` (classification), in eval mode."""
    base: BaseModel
    meta: dict[str, Any]

    @property
    def labels(self) -> list[str] | None:
        return self.meta.get("labels")


def is_finetune_output(path: str | Path) -> bool:
    return (Path(path) / META_NAME).is_file()


def _latest_checkpoint(output: Path) -> Path:
    from scaletrain.inference import find_checkpoint

    try:
        return find_checkpoint(output)[1]
    except ValueError:
        raise FinetuneError(f"{output} has no complete checkpoint under checkpoints/; "
                            "the run did not finish a save") from None


def _load_trained(model: nn.Module, directory: Path) -> None:
    from scaletrain.train.native_format import load_state

    state = {"model": model.state_dict()}
    load_state(state, directory)  # hashes, safe metadata, shapes, finite values
    model.load_state_dict(state["model"])


def load_finetuned(output: str | Path, device: torch.device | str = "cpu",
                   dtype: torch.dtype | None = None, merge: bool = True) -> Finetuned:
    """The fine-tuned model of run directory `output`.

    LoRA/QLoRA: the full-precision base with `output/adapter` applied (merged into the weights
    when `merge`; a QLoRA adapter is thus merged into the unquantized base). Full/freeze: the
    latest checkpoint's weights.
    """
    from scaletrain.finetune.lora import merge_lora
    from scaletrain.finetune.peft_io import load_adapter

    output = Path(output)
    meta = read_meta(output)
    base = load_base(base_path(meta), device)
    check_base(meta, base.directory, output / META_NAME)
    backbone = base.model
    labels = meta.get("labels")
    model: nn.Module = backbone
    if meta["task"] == "classification":
        model = SequenceClassifier(backbone, len(labels))
    head = model.score if isinstance(model, SequenceClassifier) else None
    if meta["method"] in ("lora", "qlora"):
        load_adapter(output / ADAPTER_DIR, backbone, head)
        if merge:
            merge_lora(backbone)
    else:
        _load_trained(model, _latest_checkpoint(output))
    if dtype is not None:
        model.to(dtype)
        backbone.reset_buffers()
    model.eval()
    log.info("loaded %s %s fine-tune from %s (base %s)", meta["method"], meta["task"], output,
             meta["base"])
    return Finetuned(model, base, meta)


def load_for_export(output: str | Path, dtype: torch.dtype = torch.float32
                    ) -> tuple[nn.Module, ModelArgs, Path, int | None]:
    """(merged language model, args, base tokenizer file or None, eos id) for `convert`."""
    done = load_finetuned(output, dtype=dtype)
    if done.meta["task"] != "sft":
        raise FinetuneError(f"{output} is a {done.meta['task']} fine-tune; only language "
                            "models (task sft) convert to a causal-LM checkpoint")
    return done.model, done.base.args, done.base.tokenizer_path, done.base.eos_id


__all__ = ["Finetuned", "load_finetuned", "load_for_export", "is_finetune_output"]
