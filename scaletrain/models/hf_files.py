"""The weight files of a Hugging Face checkpoint: which they are, the tensor shapes their
safetensors headers declare (read without loading a tensor), their tensors; and how a
`config.json` names the sizes `models.stored_shapes` checks (`num_hidden_layers`, ...)."""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch

from scaletrain.models.stored_shapes import Manifest

_EXPERT = re.compile(r"\.experts\.(\d+)\.")

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"

# `ModelArgs` field -> config.json key, per model type (Llama-layout families share one).
_GPT2_LABELS = {"n_layers": "n_layer", "dim": "n_embd", "max_seq_len": "n_positions",
                "ffn_dim": "n_inner"}
_ROPE_LABELS = {"n_layers": "num_hidden_layers", "dim": "hidden_size",
                "max_seq_len": "max_position_embeddings", "ffn_dim": "intermediate_size",
                "moe_ffn_dim": "moe_intermediate_size"}


def weight_files(directory: Path) -> list[Path]:
    """`model.safetensors`, else the shards `model.safetensors.index.json` lists (each a file
    name inside `directory`)."""
    single, index = directory / WEIGHTS_NAME, directory / INDEX_NAME
    if single.is_file():
        return [single]
    if not index.is_file():
        raise FileNotFoundError(
            f"no weights in {directory}: expected {WEIGHTS_NAME} or {INDEX_NAME} "
            "(PyTorch .bin checkpoints are not read; re-save them with safetensors)"
        )
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
        shards = sorted(set(weight_map.values()))
    except (json.JSONDecodeError, KeyError, TypeError, AttributeError) as e:
        raise ValueError(f"{index} is damaged (needs a 'weight_map' object): {e}") from None
    for shard in shards:
        if not isinstance(shard, str) or Path(shard).name != shard or shard in ("", ".", ".."):
            raise ValueError(f"{index} names shard {shard!r}, which is not a file name in "
                             f"{directory}")
    return [directory / shard for shard in shards]


def header_shapes(files: list[Path]) -> dict[str, tuple[int, ...]]:
    """Tensor name -> shape from the safetensors headers of `files` (no tensor is read)."""
    from safetensors import SafetensorError, safe_open

    shapes: dict[str, tuple[int, ...]] = {}
    for path in files:
        if not path.is_file():
            raise FileNotFoundError(f"{path} not found")
        try:
            with safe_open(str(path), framework="pt") as f:
                for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                    shapes[name] = tuple(f.get_slice(name).get_shape())
        except (SafetensorError, OSError, ValueError, RuntimeError) as e:
            raise ValueError(f"{path} is damaged or not a safetensors file: {e}") from None
    return shapes


def _read_safetensors(path: Path) -> dict[str, torch.Tensor]:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    if not path.is_file():
        raise FileNotFoundError(f"{path} not found")
    try:
        return load_file(path, device="cpu")
    except (SafetensorError, OSError, ValueError, RuntimeError) as e:
        raise ValueError(f"{path} is damaged or not a safetensors file: {e}") from None


def read_hf_weights(directory: str | os.PathLike) -> dict[str, torch.Tensor]:
    """All tensors of a HF checkpoint: `model.safetensors` or the shards its index lists."""
    directory = Path(directory)
    files = weight_files(directory)
    tensors: dict[str, torch.Tensor] = {}
    for shard in files:
        tensors.update(_read_safetensors(shard))
    if not (directory / WEIGHTS_NAME).is_file():  # shards: each listed tensor was found
        weight_map = json.loads((directory / INDEX_NAME).read_text())["weight_map"]
        listed_missing = sorted(k for k in weight_map if k not in tensors)
        if listed_missing:
            raise ValueError(f"{directory / INDEX_NAME} lists tensor(s) absent from their "
                             f"shard: {', '.join(listed_missing[:5])}")
    return tensors


def hf_manifest(directory: Path, cfg: dict[str, Any], files: list[Path]) -> Manifest:
    """The `Manifest` of a checkpoint's config.json, its fields under their config names."""
    model_type = cfg.get("model_type")
    labels = dict(_GPT2_LABELS if model_type == "gpt2" else _ROPE_LABELS)
    labels["n_experts"] = "num_experts" if model_type == "qwen3_moe" else "num_local_experts"
    weights = files[0].name if len(files) == 1 else f"{INDEX_NAME}'s {len(files)} shards"
    return Manifest(directory / CONFIG_NAME, weights, labels)


def config_layer_count(cfg: dict[str, Any]) -> Any:
    """The layer count a config.json states, as stored (validated by the caller)."""
    return cfg.get("n_layer") if cfg.get("model_type") == "gpt2" else cfg.get("num_hidden_layers")


def check_expert_count(names: Iterable[str], n_experts: int, manifest: Manifest) -> None:
    """Refuse an expert count other than the per-expert tensors stored (experts 0 .. n-1);
    checkpoints with fused expert tensors are checked by shape instead."""
    found = {int(m.group(1)) for name in names if (m := _EXPERT.search(name))}
    if found and (len(found) != n_experts or max(found) != n_experts - 1):
        raise manifest.refuse("n_experts", n_experts,
                              f"holds tensors of {len(found)} experts (numbered up to "
                              f"{max(found)})")


__all__ = ["read_hf_weights", "CONFIG_NAME", "WEIGHTS_NAME", "INDEX_NAME", "weight_files",
           "header_shapes", "hf_manifest", "config_layer_count", "check_expert_count"]
