"""A fine-tuning run's result for inference (predict, convert), through the one loader."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from scaletrain.finetune.base import FinetuneError
from scaletrain.loader import FINETUNE_META, LoadedModel, load_model
from scaletrain.models.args import ModelArgs

log = logging.getLogger("scaletrain.finetune")


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


__all__ = ["Finetuned", "load_finetuned", "load_for_export", "is_finetune_output"]
