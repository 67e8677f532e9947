"""Load a model for inference from whatever checkpoint directory the user points at.

Accepted: a Hugging Face directory (`config.json` + safetensors), a native checkpoint
(`meta.json` + DCP files), a training run's output directory with
`checkpoints/step-XXXXXXX/` sub-directories (the latest complete one is used), or a
`scaletrain finetune` output directory (`finetune.json`: base + adapter or trained weights).
"""

from __future__ import annotations

import json
import logging
import os
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from scaletrain.models.args import ModelArgs
from scaletrain.models.hf import CONFIG_NAME, GENERATION_CONFIG_NAME, load_hf_checkpoint
from scaletrain.models.transformer import Transformer
from scaletrain.train.native_format import META_NAME, load_model_checkpoint

if TYPE_CHECKING:
    from tokenizers import Tokenizer

logger = logging.getLogger(__name__)

_STEP_DIR = re.compile(r"step-(\d+)")
# Special tokens that end a document in common tokenizers, most specific first.
_EOS_NAMES = ("<|end_of_text|>", "<|endoftext|>", "</s>", "<eos>", "<|eos|>", "[EOS]")


def find_checkpoint(path: str | os.PathLike) -> tuple[str, Path]:
    """("hf" | "native", directory) for a checkpoint or a training run directory."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"{path} does not exist")
    if not path.is_dir():
        raise ValueError(f"{path} is a file; give the checkpoint directory that holds it")
    if (path / META_NAME).is_file():
        return "native", path
    if (path / CONFIG_NAME).is_file():
        return "hf", path
    for parent in (path / "checkpoints", path):
        steps = [
            (int(m.group(1)), d) for d in parent.glob("step-*")
            if (m := _STEP_DIR.fullmatch(d.name)) and (d / META_NAME).is_file()
        ] if parent.is_dir() else []
        if steps:
            step, latest = max(steps)
            logger.info("using the latest checkpoint %s (step %d)", latest, step)
            return "native", latest
    raise ValueError(
        f"{path} is not a checkpoint: expected {CONFIG_NAME} (Hugging Face), {META_NAME} "
        "(scaletrain native) or a run directory with checkpoints/step-XXXXXXX/ inside"
    )


def _load_tokenizer(path: Path | None) -> Tokenizer | None:
    if path is None or not path.is_file():
        return None
    from tokenizers import Tokenizer

    try:
        return Tokenizer.from_file(str(path))
    except Exception as e:  # tokenizers raises its own exception type
        raise ValueError(f"{path} is not a valid tokenizers JSON file: {e}") from None


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        logger.warning("ignoring unreadable %s: %s", path, e)
        return {}
    return data if isinstance(data, dict) else {}


def _first_id(value: Any) -> int | None:
    """An eos id from a config: an int, or the first of a list."""
    if isinstance(value, list):
        value = value[0] if value else None
    return value if isinstance(value, int) else None


def hf_eos_id(directory: Path) -> int | None:
    """eos id from generation_config.json, else config.json (the first when there are several)."""
    for name in (GENERATION_CONFIG_NAME, CONFIG_NAME):
        path = directory / name
        if path.is_file():
            eos = _first_id(_read_json(path).get("eos_token_id"))
            if eos is not None:
                return eos
    return None


def tokenizer_eos_id(tokenizer: Tokenizer | None) -> int | None:
    """Best guess at the end-of-text id of a tokenizer that carries no config, by token name."""
    if tokenizer is None:
        return None
    for name in _EOS_NAMES:
        token_id = tokenizer.token_to_id(name)
        if token_id is not None:
            return token_id
    return None


def _token_text(value: Any) -> str | None:
    if isinstance(value, dict):  # {"content": "<s>", ...} in older tokenizer configs
        value = value.get("content")
    return value if isinstance(value, str) else None


def read_chat_template(directory: Path) -> tuple[str | None, dict[str, str]]:
    """(chat template, special-token strings) from `tokenizer_config.json` (or the separate
    `chat_template.jinja` newer tokenizers write), when present."""
    template, special = None, {}
    config = directory / "tokenizer_config.json"
    if config.is_file():
        try:
            data = json.loads(config.read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise ValueError(f"{config} is not valid JSON: {e}") from None
        template = data.get("chat_template")
        if isinstance(template, list):  # named templates: take "default"
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
            template = named.get("default")
        for key in ("bos_token", "eos_token", "pad_token", "unk_token"):
            text = _token_text(data.get(key))
            if text is not None:
                special[key] = text
    jinja = directory / "chat_template.jinja"
    if template is None and jinja.is_file():
        template = jinja.read_text()
    return (template if isinstance(template, str) else None), special


def load_chat_template(path: str | os.PathLike) -> tuple[str | None, dict[str, str]]:
    """The chat template of any model directory; a fine-tuning run's is its base model's."""
    meta_path = Path(path) / "finetune.json"
    if meta_path.is_file():
        base = _read_json(meta_path).get("base")
        if not isinstance(base, str):
            raise ValueError(f"{meta_path} names no base model")
        return load_chat_template(base)
    return read_chat_template(find_checkpoint(path)[1])


def load_for_inference(
    path: str | os.PathLike,
    device: torch.device | str = "cpu",
    dtype: torch.dtype | None = None,
) -> tuple[Transformer, ModelArgs, Tokenizer | None, int | None]:
    """(model in eval mode, args, tokenizer or None, eos id or None) for a checkpoint path.

    `dtype=None` keeps a HF checkpoint's stored dtype and loads native checkpoints in float32.
    """
    if (Path(path) / "finetune.json").is_file():  # a `scaletrain finetune` run: base + result
        return _load_finetuned(path, device, dtype)
    kind, directory = find_checkpoint(path)
    if kind == "hf":
        model, args = load_hf_checkpoint(directory, device=device, dtype=dtype)
        tokenizer = _load_tokenizer(directory / "tokenizer.json")
        eos = hf_eos_id(directory)
        if eos is None:
            eos = tokenizer_eos_id(tokenizer)
    else:
        model, args, tok_path = load_model_checkpoint(
            directory, device=device, dtype=dtype or torch.float32
        )
        tokenizer = _load_tokenizer(tok_path)
        eos = tokenizer_eos_id(tokenizer)
    if eos is not None and not 0 <= eos < args.vocab_size:
        logger.warning("ignoring eos id %d outside the vocabulary (%d)", eos, args.vocab_size)
        eos = None
    model.eval()
    return model, args, tokenizer, eos


def _load_finetuned(
    path: str | os.PathLike, device: torch.device | str, dtype: torch.dtype | None
) -> tuple[Transformer, ModelArgs, Tokenizer | None, int | None]:
    from scaletrain.finetune.loading import load_finetuned

    done = load_finetuned(path, device=device, dtype=dtype)
    if not isinstance(done.model, Transformer):
        raise ValueError(f"{path} is a {done.meta['task']} fine-tune, not a language model; "
                         "use `scaletrain predict --checkpoint` with it")
    return done.model, done.base.args, done.base.tokenizer, done.base.eos_id


__all__ = ["find_checkpoint", "load_for_inference", "load_chat_template", "read_chat_template",
           "hf_eos_id", "tokenizer_eos_id"]
