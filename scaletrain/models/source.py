"""A model's dimensions from a preset name or a Hugging Face `config.json` (file or folder).

`scaletrain plan`, `plan search` and `train --dry-run` (`--model.name`) accept either, so users
can plan their own model before any weights exist.
"""

from __future__ import annotations

from pathlib import Path

from scaletrain.models.args import PRESETS, ModelArgs, get_preset
from scaletrain.models.hf import model_args_from_hf_config, read_config_file, read_hf_config


def is_hf_config_path(name: str) -> bool:
    """True when `name` is not a preset but an existing file or folder."""
    return name not in PRESETS and Path(name).exists()


def load_model_args(name: str) -> ModelArgs:
    """The preset called `name`, else the dimensions of the Hugging Face `config.json` at
    `name` (the file, or a folder holding it). Errors name the file or list the presets."""
    if not is_hf_config_path(name):
        return get_preset(name)  # KeyError listing the presets
    path = Path(name)
    if path.is_dir():
        try:
            cfg = read_hf_config(path)
        except FileNotFoundError as e:
            raise ValueError(str(e)) from None
    else:
        cfg = read_config_file(path)
    try:
        return model_args_from_hf_config(cfg)
    except (KeyError, TypeError) as e:
        raise ValueError(f"{path}: not a usable Hugging Face config ({e})") from None
