"""LoRA adapters in PEFT's on-disk format: `adapter_config.json` + `adapter_model.safetensors`,
with tensor names as PEFT gives them for transformers' `LlamaForCausalLM` (SFT) or
`LlamaForSequenceClassification` (classification), so `PeftModel.from_pretrained` loads them.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path
from typing import Any

import torch
from torch import nn

from scaletrain.finetune.lora import HF_TARGETS, TARGETS, LoRASettings, adapter_modules, apply_lora
from scaletrain.models.files import honour_umask, make_output_dir
from scaletrain.models.hf import _LLAMA_LAYER

CONFIG_NAME = "adapter_config.json"
WEIGHTS_NAME = "adapter_model.safetensors"
_PREFIX = "base_model.model."
_NORMS = ("input_layernorm", "post_attention_layernorm", "norm")


class AdapterError(ValueError):
    """An adapter directory that cannot be read or written; the message says why."""


def _hf_name(name: str) -> str:
    """Our module name ('layers.3.attention.wq', 'norm') -> HF Llama's ('model.layers.3...')."""
    m = re.fullmatch(r"layers\.(\d+)\.(.+)", name)
    if m:
        return f"model.layers.{m.group(1)}.{_LLAMA_LAYER[m.group(2)]}"
    return {"norm": "model.norm"}[name]


def _our_name(hf: str) -> str:
    reverse = {v: k for k, v in _LLAMA_LAYER.items()}
    m = re.fullmatch(r"model\.layers\.(\d+)\.(.+)", hf)
    if m and m.group(2) in reverse:
        return f"layers.{m.group(1)}.{reverse[m.group(2)]}"
    if hf == "model.norm":
        return "norm"
    raise AdapterError(f"adapter tensor for '{hf}' names no module of a Llama model")


def adapter_tensors(backbone: nn.Module, head: nn.Linear | None = None,
                    train_norms: bool = False) -> dict[str, torch.Tensor]:
    """The tensors PEFT saves, under PEFT's names (adapter name left out, as PEFT saves)."""
    if backbone.args.arch != "llama":
        raise AdapterError(f"PEFT adapters are written for Llama models; this base is "
                           f"'{backbone.args.arch}' (use --method full or freeze)")
    out: dict[str, torch.Tensor] = {}
    for name, lora in adapter_modules(backbone).items():
        hf = _PREFIX + _hf_name(name)
        out[f"{hf}.lora_A.weight"] = lora.lora_A.weight
        out[f"{hf}.lora_B.weight"] = lora.lora_B.weight
    if train_norms:
        for name, module in backbone.named_modules():
            clean = name.replace("_checkpoint_wrapped_module.", "")
            if clean.rpartition(".")[2] in ("attention_norm", "ffn_norm") or clean == "norm":
                out[f"{_PREFIX}{_hf_name(clean)}.weight"] = module.weight
    if head is not None:
        out[f"{_PREFIX}score.weight"] = head.weight
    return {k: v.detach().to("cpu", copy=True).contiguous() for k, v in out.items()}


def save_adapter(directory: str | os.PathLike, backbone: nn.Module, settings: LoRASettings, *,
                 base_path: str, head: nn.Linear | None = None,
                 train_norms: bool = False) -> Path:
    """Write the adapter into `directory` (replaced atomically if it exists)."""
    from safetensors.torch import save_file

    directory = Path(directory)
    tensors = adapter_tensors(backbone, head, train_norms)
    to_save = (["score"] if head is not None else []) + (list(_NORMS) if train_norms else [])
    config: dict[str, Any] = {
        "peft_type": "LORA",
        "task_type": "SEQ_CLS" if head is not None else "CAUSAL_LM",
        "base_model_name_or_path": base_path,
        "r": settings.rank,
        "lora_alpha": settings.alpha,
        "lora_dropout": settings.dropout,
        "target_modules": sorted(HF_TARGETS[t] for t in settings.targets),
        "bias": "none",
        "fan_in_fan_out": False,
        "inference_mode": True,
        "init_lora_weights": True,
        "use_rslora": False,
        "use_dora": False,
        "modules_to_save": to_save or None,
        "layers_to_transform": None,
        "layers_pattern": None,
        "rank_pattern": {},
        "alpha_pattern": {},
        "revision": None,
    }
    tmp = make_output_dir(directory)
    try:
        (tmp / CONFIG_NAME).write_text(json.dumps(config, indent=2) + "\n")
        save_file(tensors, tmp / WEIGHTS_NAME, metadata={"format": "pt"})
        honour_umask(tmp)
        old = directory.with_name(directory.name + ".old")
        if directory.exists():
            shutil.rmtree(old, ignore_errors=True)
            directory.rename(old)
        tmp.rename(directory)
        shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return directory


def read_adapter_config(directory: str | os.PathLike) -> dict[str, Any]:
    path = Path(directory) / CONFIG_NAME
    if not path.is_file():
        raise AdapterError(f"{path} not found: not a PEFT adapter directory")
    try:
        config = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise AdapterError(f"{path} is not valid JSON: {e}") from None
    if config.get("peft_type") != "LORA":
        raise AdapterError(f"{path}: peft_type {config.get('peft_type')!r} is not supported "
                           "(only LORA)")
    for flag in ("use_dora", "use_rslora", "fan_in_fan_out"):
        if config.get(flag):
            raise AdapterError(f"{path}: {flag}=true is not supported")
    if config.get("bias", "none") != "none":
        raise AdapterError(f"{path}: bias={config['bias']!r} is not supported (only 'none')")
    if not isinstance(config.get("target_modules"), list):
        raise AdapterError(f"{path}: target_modules must be a list of module names")
    return config


def load_adapter(directory: str | os.PathLike, backbone: nn.Module,
                 head: nn.Linear | None = None) -> LoRASettings:
    """Wrap `backbone` with the adapter's LoRA layers and load its weights (and the head's)."""
    from safetensors.torch import load_file

    directory = Path(directory)
    config = read_adapter_config(directory)
    reverse = {v: k for k, v in HF_TARGETS.items()}
    unknown = [t for t in config["target_modules"] if t not in reverse and t not in TARGETS]
    if unknown:
        raise AdapterError(f"{directory / CONFIG_NAME}: target module(s) {unknown} are not "
                           f"Llama linear layers ({', '.join(HF_TARGETS.values())})")
    settings = LoRASettings(int(config["r"]), float(config["lora_alpha"]),
                            float(config.get("lora_dropout", 0.0)),
                            tuple(reverse.get(t, t) for t in config["target_modules"]))
    apply_lora(backbone, settings)
    tensors = load_file(directory / WEIGHTS_NAME)
    layers = adapter_modules(backbone)
    loaded = set()
    with torch.no_grad():
        for key, value in tensors.items():
            if not key.startswith(_PREFIX):
                raise AdapterError(f"{directory / WEIGHTS_NAME}: unexpected tensor {key}")
            name = key[len(_PREFIX):]
            if name == "score.weight":
                if head is None or head.weight.shape != value.shape:
                    raise AdapterError(f"{directory}: its classification head has shape "
                                       f"{tuple(value.shape)}, which does not match the model's "
                                       f"{None if head is None else tuple(head.weight.shape)}")
                head.weight.copy_(value)
            elif m := re.fullmatch(r"(.+)\.(lora_[AB])\.weight", name):
                target = getattr(layers[_our_name(m.group(1))], m.group(2)).weight
                target.copy_(value.to(target.dtype))
            elif m := re.fullmatch(r"(.+)\.weight", name):
                backbone.get_submodule(_our_name(m.group(1))).weight.copy_(value)
            else:
                raise AdapterError(f"{directory / WEIGHTS_NAME}: unexpected tensor {key}")
            loaded.add(name)
    expected = {f"{_hf_name(n)}.{ab}.weight" for n in layers for ab in ("lora_A", "lora_B")}
    if expected - loaded:
        raise AdapterError(f"{directory / WEIGHTS_NAME} lacks {len(expected - loaded)} LoRA "
                           f"tensor(s), e.g. {sorted(expected - loaded)[0]}")
    return settings


__all__ = ["save_adapter", "load_adapter", "adapter_tensors", "read_adapter_config",
           "AdapterError", "CONFIG_NAME", "WEIGHTS_NAME"]
