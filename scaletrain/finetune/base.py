"""The model being adapted: weights, tokenizer and chat template, from the one loader."""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from scaletrain.inference.loader import LoadedModel, load_model, model_args_of, read_chat_template
from scaletrain.models.transformer import Transformer

log = logging.getLogger(__name__)

BaseModel = LoadedModel
"""The base model of a fine-tune: a `LoadedModel` whose model is a `Transformer` with a
tokenizer."""


class FinetuneError(ValueError):
    """Input that fine-tuning cannot use; the message names the thing and the fix."""


def check_base_manifest(path: str | Path) -> None:
    """Refuse a base whose manifest (meta.json / config.json) the stored tensor shapes do not
    bear out, in milliseconds and before the run writes anything into its output."""
    try:
        model_args_of(path)
    except (OSError, ValueError, KeyError) as e:
        raise FinetuneError(f"base model {path}: {e}") from None


def load_base(path: str | Path, device: torch.device | str = "cpu",
              weights: bool = True) -> LoadedModel:
    """Load the base model (fp32, train mode) and its tokenizer from any model directory.
    `weights=False`: the model stays on the meta device, to be sharded, then filled by
    `finetune.base_sharded.materialize` with the parts each rank owns."""
    try:
        base = load_model(path, device=device, dtype=torch.float32, weights=weights)
    except (OSError, ValueError, KeyError) as e:
        raise FinetuneError(f"base model {path}: {e}") from None
    if not isinstance(base.model, Transformer):
        raise FinetuneError(f"base model {path} is a classification fine-tune; give a language "
                            "model as the base")
    if base.tokenizer is None or base.tokenizer_path is None:
        raise FinetuneError(
            f"base model {path} has no tokenizer.json; fine-tuning reads text, so put the "
            "model's tokenizer.json next to its weights"
        )
    base.model.train()
    log.info("base model %s: %s, %d layers, dim %d", base.directory, base.args.family,
             base.args.n_layers, base.args.dim)
    return base


__all__ = ["BaseModel", "FinetuneError", "check_base_manifest", "load_base", "read_chat_template"]
