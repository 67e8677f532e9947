"""The model being adapted: weights, tokenizer and chat template from any checkpoint we read."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from scaletrain.inference import read_chat_template
from scaletrain.models.args import ModelArgs
from scaletrain.models.transformer import Transformer

if TYPE_CHECKING:
    from tokenizers import Tokenizer

log = logging.getLogger("scaletrain.finetune")


class FinetuneError(ValueError):
    """Input that fine-tuning cannot use; the message names the thing and the fix."""


@dataclass
class BaseModel:
    model: Transformer
    args: ModelArgs
    directory: Path
    """The checkpoint directory the weights came from."""
    tokenizer: Tokenizer
    tokenizer_path: Path
    eos_id: int | None
    chat_template: str | None = None
    special_tokens: dict[str, str] | None = None
    """Special-token strings for the chat template (bos_token, eos_token, ...)."""

    @property
    def pad_id(self) -> int:
        """Id written into padding positions (never attended to nor scored)."""
        return self.eos_id if self.eos_id is not None else 0


def load_base(path: str | Path, device: torch.device | str = "cpu") -> BaseModel:
    """Load the base model (fp32) and its tokenizer from a HF dir, native checkpoint or run."""
    from scaletrain.inference import load_for_inference

    try:
        model, args, tokenizer, eos = load_for_inference(path, device=device, dtype=torch.float32)
    except (OSError, ValueError, KeyError) as e:
        raise FinetuneError(f"base model {path}: {e}") from None
    from scaletrain.inference import find_checkpoint

    kind, directory = find_checkpoint(path)
    tok_path = directory / "tokenizer.json"
    if kind == "native" and not tok_path.is_file():
        from scaletrain.train.native_format import read_meta

        tok_path = directory / (read_meta(directory).get("tokenizer") or "tokenizer.json")
    if tokenizer is None or not tok_path.is_file():
        raise FinetuneError(
            f"base model {path} has no tokenizer.json; fine-tuning reads text, so put the "
            "model's tokenizer.json next to its weights"
        )
    try:
        template, special = read_chat_template(directory)
    except ValueError as e:
        raise FinetuneError(str(e)) from None
    model.train()
    log.info("base model %s: %s, %d layers, dim %d", directory, args.arch, args.n_layers,
             args.dim)
    return BaseModel(model, args, directory, tokenizer, tok_path, eos, template, special)


__all__ = ["BaseModel", "FinetuneError", "load_base", "read_chat_template"]
