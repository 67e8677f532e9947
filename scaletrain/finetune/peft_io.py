"""LoRA adapters in PEFT's on-disk format: `adapter_config.json` + `adapter_model.safetensors`,
with tensor names as PEFT gives them for the base's transformers class (`LlamaForCausalLM`,
`Qwen2ForCausalLM`, ..., `*ForSequenceClassification`), so `PeftModel.from_pretrained` loads
them. Module names come from the family's HF layout (`models/hf_families.py`); Phi-3's fused
projections go through `peft_fused`.
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

from scaletrain.finetune import lora_experts, peft_fused
from scaletrain.finetune.lora import HF_TARGETS, TARGETS, LoRASettings, adapter_modules, apply_lora
from scaletrain.models.args import ModelArgs
from scaletrain.models.files import honour_umask, make_output_dir
from scaletrain.models.hf_families import fused_map, layer_map
from scaletrain.train.step import full_value

CONFIG_NAME = "adapter_config.json"
WEIGHTS_NAME = "adapter_model.safetensors"
_PREFIX = "base_model.model."
_TRAINED_NORMS = ("attention_norm", "ffn_norm")  # what finetune.train_norms trains, and `norm`


class AdapterError(ValueError):
    """An adapter directory that cannot be read or written; the message says why."""


def _hf_name(name: str, args: ModelArgs) -> str:
    """Our module name ('layers.3.attention.wq', 'norm') -> the family's HF name."""
    m = re.fullmatch(r"layers\.(\d+)\.(.+)", name)
    if m:
        return f"model.layers.{m.group(1)}.{layer_map(args)[m.group(2)]}"
    return {"norm": "model.norm"}[name]


def _our_name(hf: str, args: ModelArgs) -> str:
    reverse = {v: k for k, v in layer_map(args).items()}
    m = re.fullmatch(r"model\.layers\.(\d+)\.(.+)", hf)
    if m and m.group(2) in reverse:
        return f"layers.{m.group(1)}.{reverse[m.group(2)]}"
    if hf == "model.norm":
        return "norm"
    raise AdapterError(f"adapter tensor for '{hf}' names no module of a {args.family} model")


def _fused_groups(args: ModelArgs) -> dict[str, tuple[str, ...]]:
    """HF fused module (last name part) -> our block modules, e.g. qkv_proj -> wq, wk, wv."""
    return {hf.rpartition(".")[2]: parts for hf, parts in fused_map(args).items()}


def hf_target_modules(targets: tuple[str, ...], args: ModelArgs) -> list[str]:
    """PEFT `target_modules` for our short targets; fused groups must be targeted whole. On an
    MoE model gate/up/down are the experts' `target_parameters` (`hf_target_parameters`)."""
    if args.is_moe:
        targets = tuple(t for t in targets if t not in lora_experts.EXPERT_TARGETS)
    names = {HF_TARGETS[t] for t in targets}
    for fused, parts in _fused_groups(args).items():
        short = [t for t, mod in TARGETS.items() if mod in parts]
        chosen = [t for t in short if t in targets]
        if chosen and len(chosen) != len(short):
            raise AdapterError(f"a {args.family} checkpoint fuses {','.join(short)} into "
                               f"{fused}: put all of them in finetune.lora_targets or none")
        if chosen:
            names = (names - {HF_TARGETS[t] for t in chosen}) | {fused}
    return sorted(names)


def hf_target_parameters(targets: tuple[str, ...], args: ModelArgs) -> list[str]:
    """PEFT `target_parameters`: the fused expert tensors of an MoE model that LoRA adapts."""
    if not args.is_moe:
        return []
    out = []
    if "gate" in targets or "up" in targets:
        out.append(lora_experts.PEFT_PARAMETERS["gate_up"])
    if "down" in targets:
        out.append(lora_experts.PEFT_PARAMETERS["down"])
    return out


def adapter_tensors(backbone: nn.Module, head: nn.Linear | None = None,
                    train_norms: bool = False) -> dict[str, torch.Tensor]:
    """The tensors PEFT saves, under PEFT's names (adapter name left out, as PEFT saves).
    Whole tensors under FSDP too: every rank calls it then (the gathers are collectives)."""
    args: ModelArgs = backbone.args
    if args.arch != "llama":
        raise AdapterError(f"PEFT adapters are written for RoPE-family models; this base is "
                           f"'{args.arch}' (use --method full or freeze)")
    out: dict[str, torch.Tensor] = {}
    modules = adapter_modules(backbone)
    fused_of = {part: fused for fused, parts in _fused_groups(args).items() for part in parts}
    for name, lora in modules.items():
        layer, _, module = name.partition(".")[2].partition(".")
        if module in fused_of:
            continue
        hf = _PREFIX + _hf_name(name, args)
        out[f"{hf}.lora_A.weight"] = full_value(lora.lora_A.weight)
        out[f"{hf}.lora_B.weight"] = full_value(lora.lora_B.weight)
    for fused, parts in fused_map(args).items():  # e.g. "self_attn.qkv_proj"
        for i in range(args.n_layers):
            present = [modules.get(f"layers.{i}.{p}") for p in parts]
            if not any(present):
                continue
            if not all(present):
                raise AdapterError(f"layer {i}: a {args.family} checkpoint fuses {parts} into "
                                   f"{fused}; LoRA must wrap all of them or none")
            a, b = peft_fused.fuse([(full_value(m.lora_A.weight), full_value(m.lora_B.weight))
                                    for m in present])
            hf = f"{_PREFIX}model.layers.{i}.{fused}"
            out[f"{hf}.lora_A.weight"], out[f"{hf}.lora_B.weight"] = a, b
    out.update({_PREFIX + k: v for k, v in lora_experts.peft_expert_tensors(backbone).items()})
    if train_norms:
        # PEFT wraps every module whose name ends with a `modules_to_save` entry ("norm" also
        # catches Qwen3's q/k norms and Gemma 2's post-norms) and expects all of them saved.
        for name, module in backbone.named_modules():
            clean = name.replace("_checkpoint_wrapped_module.", "")
            if clean.endswith("norm") and hasattr(module, "weight"):
                out[f"{_PREFIX}{_hf_name(clean, args)}.weight"] = full_value(module.weight)
    if head is not None:
        out[f"{_PREFIX}score.weight"] = full_value(head.weight)
    return {k: v.detach().to("cpu", copy=True).contiguous() for k, v in out.items()}


def save_adapter(directory: str | os.PathLike, backbone: nn.Module, settings: LoRASettings, *,
                 base_path: str, head: nn.Linear | None = None, train_norms: bool = False,
                 tensors: dict[str, torch.Tensor] | None = None) -> Path:
    """Write the adapter into `directory` (replaced atomically if it exists). `tensors`: the
    `adapter_tensors` already gathered (under FSDP every rank gathers, one writes)."""
    from safetensors.torch import save_file

    directory = Path(directory)
    args: ModelArgs = backbone.args
    targets = hf_target_modules(settings.targets, args)
    if tensors is None:
        tensors = adapter_tensors(backbone, head, train_norms)
    norms = [layer_map(args)[n].rpartition(".")[2] for n in _TRAINED_NORMS] + ["norm"]
    to_save = (["score"] if head is not None else []) + (norms if train_norms else [])
    fused = [t for t in targets if t in _fused_groups(args)]
    config: dict[str, Any] = {
        "peft_type": "LORA",
        "task_type": "SEQ_CLS" if head is not None else "CAUSAL_LM",
        "base_model_name_or_path": base_path,
        "r": settings.rank,
        "lora_alpha": settings.alpha,
        "lora_dropout": settings.dropout,
        "target_modules": targets,
        "target_parameters": hf_target_parameters(settings.targets, args) or None,
        "bias": "none",
        "fan_in_fan_out": False,
        "inference_mode": True,
        "init_lora_weights": True,
        "use_rslora": False,
        "use_dora": False,
        "modules_to_save": to_save or None,
        "layers_to_transform": None,
        "layers_pattern": None,
        "rank_pattern": {f: settings.rank * len(_fused_groups(args)[f]) for f in fused},
        "alpha_pattern": {f: settings.alpha * len(_fused_groups(args)[f]) for f in fused},
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
    args: ModelArgs = backbone.args
    reverse = {v: k for k, v in HF_TARGETS.items()}
    groups = _fused_groups(args)
    short_of = {mod: t for t, mod in TARGETS.items()}
    targets: list[str] = []
    unknown = []
    try:
        targets += lora_experts.targets_of_parameters(config.get("target_parameters") or [])
    except lora_experts.ExpertLoRAError as e:
        raise AdapterError(f"{directory / CONFIG_NAME}: {e}") from None
    dense_mlp = {HF_TARGETS[t] for t in lora_experts.EXPERT_TARGETS}
    if targets and not args.is_moe or args.is_moe and dense_mlp & set(config["target_modules"]):
        raise AdapterError(f"{directory / CONFIG_NAME}: its targets "
                           f"{config.get('target_parameters') or config['target_modules']} do "
                           f"not fit this {'MoE' if args.is_moe else 'dense'} {args.family} model")
    for t in config["target_modules"]:
        if t in groups:
            targets += [short_of[p] for p in groups[t]]
        elif t in reverse or t in TARGETS:
            targets.append(reverse.get(t, t))
        else:
            unknown.append(t)
    hf_names = sorted(set(HF_TARGETS.values()) - {HF_TARGETS[short_of[p]] for g in groups.values()
                                                  for p in g} | set(groups))
    if unknown:
        raise AdapterError(f"{directory / CONFIG_NAME}: target module(s) {unknown} are not "
                           f"{args.family} linear layers ({', '.join(hf_names)})")
    settings = LoRASettings(int(config["r"]), float(config["lora_alpha"]),
                            float(config.get("lora_dropout", 0.0)), tuple(targets))
    apply_lora(backbone, settings)
    tensors = load_file(directory / WEIGHTS_NAME)
    layers = adapter_modules(backbone)
    experts = {k.removeprefix(_PREFIX): v for k, v in tensors.items() if ".mlp.experts." in k}
    try:
        loaded = lora_experts.load_peft_expert_tensors(backbone, experts)
    except lora_experts.ExpertLoRAError as e:
        raise AdapterError(f"{directory / WEIGHTS_NAME}: {e}") from None
    if set(experts) - loaded:
        raise AdapterError(f"{directory / WEIGHTS_NAME}: expert tensor(s) "
                           f"{sorted(set(experts) - loaded)[:2]} match no expert adapter of the "
                           "config's target_parameters")
    tensors = {k: v for k, v in tensors.items() if ".mlp.experts." not in k}
    fused_pieces: dict[str, dict[str, torch.Tensor]] = {}
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
                if m.group(1).rpartition(".")[2] in groups:
                    fused_pieces.setdefault(m.group(1), {})[m.group(2)] = value
                else:
                    target = getattr(layers[_our_name(m.group(1), args)], m.group(2)).weight
                    target.copy_(value.to(target.dtype))
            elif m := re.fullmatch(r"(.+)\.weight", name):
                backbone.get_submodule(_our_name(m.group(1), args)).weight.copy_(value)
            else:
                raise AdapterError(f"{directory / WEIGHTS_NAME}: unexpected tensor {key}")
            loaded.add(name)
        for hf, ab in fused_pieces.items():
            _load_fused(hf, ab, layers, settings, args, directory)
    expected = {f"{_hf_adapter_name(n, args)}.{ab}.weight" for n in layers
                for ab in ("lora_A", "lora_B")}
    if expected - loaded:
        raise AdapterError(f"{directory / WEIGHTS_NAME} lacks {len(expected - loaded)} LoRA "
                           f"tensor(s), e.g. {sorted(expected - loaded)[0]}")
    return settings


def _hf_adapter_name(name: str, args: ModelArgs) -> str:
    """The HF module whose LoRA holds our module `name`'s (the fused one for Phi-3 q/k/v)."""
    layer, _, module = name.partition(".")[2].partition(".")
    for fused, parts in fused_map(args).items():
        if module in parts:
            return f"model.layers.{layer}.{fused}"
    return _hf_name(name, args)


def _load_fused(hf: str, ab: dict[str, torch.Tensor], layers: dict[str, Any],
                settings: LoRASettings, args: ModelArgs, directory: Path) -> None:
    """Split one fused module's LoRA (A, B) into our per-part LoRA layers."""
    m = re.fullmatch(r"model\.layers\.(\d+)\.(.+)", hf)
    parts = fused_map(args).get(m.group(2)) if m else None
    if parts is None or set(ab) != {"lora_A", "lora_B"}:
        raise AdapterError(f"{directory / WEIGHTS_NAME}: incomplete or unknown fused LoRA {hf}")
    mods = [layers[f"layers.{m.group(1)}.{p}"] for p in parts]
    try:
        pieces = peft_fused.split(ab["lora_A"], ab["lora_B"],
                                  [mod.out_features for mod in mods], settings.rank)
    except peft_fused.FusedLoRAError as e:
        raise AdapterError(f"{directory / WEIGHTS_NAME}: {hf}: {e}") from None
    for mod, (a, b) in zip(mods, pieces, strict=True):
        mod.lora_A.weight.copy_(a.to(mod.lora_A.weight.dtype))
        mod.lora_B.weight.copy_(b.to(mod.lora_B.weight.dtype))


__all__ = ["save_adapter", "load_adapter", "adapter_tensors", "read_adapter_config",
           "hf_target_modules", "hf_target_parameters",
           "AdapterError", "CONFIG_NAME", "WEIGHTS_NAME"]
