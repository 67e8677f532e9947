"""A fine-tuning run's result for inference (predict, convert), through the one loader, and
the fine-tuned format that tells the loader how to read it (`FORMAT`, the package's
`scaletrain.finetuned_format` entry point; see `inference.finetuned`)."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from scaletrain.checkpoint.native_format import load_state
from scaletrain.finetune.base import FinetuneError
from scaletrain.finetune.base_pin import base_path, check_base
from scaletrain.finetune.format import ADAPTER_DIR
from scaletrain.finetune.heads import SequenceClassifier
from scaletrain.finetune.lora import merge_lora
from scaletrain.finetune.peft_io import load_adapter
from scaletrain.inference.finetuned import FINETUNE_META, register_finetuned_format
from scaletrain.inference.loader import LoadedModel, find_checkpoint, load_model
from scaletrain.models.args import ModelArgs

log = logging.getLogger(__name__)


@dataclass
class Finetuned:
    model: nn.Module
    """A `Transformer` (SFT) or a `SequenceClassifier` (classification), in eval mode."""
    base: LoadedModel
    """Tokenizer, eos, chat template and args of the run (its base model's)."""
    meta: dict[str, Any]

    @property
    def labels(self) -> list[str] | None:
        return self.meta.get("labels")


def is_finetune_output(path: str | Path) -> bool:
    return (Path(path) / FINETUNE_META).is_file()


def load_finetuned(output: str | Path, device: torch.device | str = "cpu",
                   dtype: torch.dtype | None = None, merge: bool = True) -> Finetuned:
    """The fine-tuned model of run directory `output` (see `loader.load_model`)."""
    if not is_finetune_output(output):
        raise FinetuneError(f"{output} is not a `scaletrain finetune` output (no "
                            f"{FINETUNE_META})")
    try:
        loaded = load_model(output, device, dtype, merge)
    except (OSError, KeyError) as e:
        raise FinetuneError(f"{output}: {e}") from None
    except ValueError as e:
        raise FinetuneError(str(e)) from None
    assert loaded.finetune is not None
    return Finetuned(loaded.model, loaded, loaded.finetune)


def load_for_export(output: str | Path, dtype: torch.dtype = torch.float32
                    ) -> tuple[nn.Module, ModelArgs, Path | None, int | None]:
    """(merged language model, args, base tokenizer file or None, eos id) for `convert`."""
    done = load_finetuned(output, dtype=dtype)
    if done.meta["task"] != "sft":
        raise FinetuneError(f"{output} is a {done.meta['task']} fine-tune; only language "
                            "models (task sft) convert to a causal-LM checkpoint")
    return done.model, done.base.args, done.base.tokenizer_path, done.base.eos_id


class FinetunedOutputs:
    """The loader's reader of `scaletrain finetune` outputs (`inference.finetuned`)."""

    def base_of(self, meta: dict[str, Any]) -> str:
        return base_path(meta)

    def check_base(self, meta: dict[str, Any], directory: Path, where: Path) -> None:
        check_base(meta, directory, where)

    def apply(self, output: Path, meta: dict[str, Any], backbone: nn.Module,
              merge: bool) -> nn.Module:
        model: nn.Module = backbone
        if meta.get("task") == "classification":
            model = SequenceClassifier(backbone, len(meta.get("labels") or []))
        head = model.score if isinstance(model, SequenceClassifier) else None
        if meta.get("method") in ("lora", "qlora"):
            load_adapter(output / ADAPTER_DIR, backbone, head)
            if merge:
                merge_lora(backbone)
            return model
        try:
            latest = find_checkpoint(output)[1]
        except ValueError:
            raise ValueError(f"{output} has no complete checkpoint under checkpoints/; the "
                             "run did not finish a save") from None
        # full weights: hashes, safe metadata, shapes and finite values checked by load_state
        state = {"model": model.state_dict()}
        load_state(state, latest)
        model.load_state_dict(state["model"])
        return model


FORMAT = FinetunedOutputs()
register_finetuned_format(FORMAT)


__all__ = ["FORMAT", "FinetunedOutputs", "Finetuned", "load_finetuned", "load_for_export",
           "is_finetune_output"]
