"""The arguments `scaletrain plan` and `scaletrain plan search` share: the model (a preset or a
Hugging Face config, with `--set` overrides), precision, optimizer and device."""

from __future__ import annotations

import argparse
import dataclasses
from typing import TYPE_CHECKING

from scaletrain.models.args import ModelArgs
from scaletrain.plan.hardware import Device, get_device
from scaletrain.plan.layout import PlanError

if TYPE_CHECKING:
    from scaletrain.config import Config

GIB, GB = 2**30, 1e9


def positive_int(value: str) -> int:
    n = int(value)
    if n <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer (got {value})")
    return n


def train_defaults(model: str) -> Config:
    """What `scaletrain train --model.name MODEL` runs: the trainer's own default config, the one
    source of plan's defaults (model dimensions, sequence length, micro-batch, precision)."""
    from scaletrain.config import default_config

    return default_config(model)


def finetune_defaults(model: str) -> Config:
    """What `scaletrain finetune` runs by default (its `finetune` preset, data parallelism read
    as DDP as fine-tuning reads `auto`): the defaults of `plan --method`."""
    from scaletrain.config import read_toml
    from scaletrain.finetune.trainer import with_ddp_default

    cfg = read_toml("finetune")
    cfg.model = dataclasses.replace(cfg.model, name=model)
    return with_ddp_default(cfg)


def parse_model(name: str, sets: list[str], pretrain: bool = True) -> ModelArgs:
    """The model `train --model.name NAME` builds (the preset or Hugging Face config, with the
    vocabulary widened to the default tokenizer's as the trainer does), or with `pretrain`
    False the base `finetune` adapts (its own dimensions and vocabulary), then `--set`."""
    if pretrain:
        from scaletrain.data.sources import resolve_model_args

        args = resolve_model_args(train_defaults(name))
    else:
        from scaletrain.models.source import load_model_args

        args = load_model_args(name)
    fields = {f.name: f for f in dataclasses.fields(ModelArgs)}
    changes = {}
    for item in sets:
        key, sep, value = item.partition("=")
        key = key.removeprefix("model.")
        if not sep or key not in fields:
            raise PlanError(f"--set {item}: expected model.FIELD=VALUE with FIELD one of "
                            f"{', '.join(fields)}")
        current = getattr(args, key)
        if isinstance(current, bool):
            changes[key] = value.lower() in ("1", "true", "yes")
        elif isinstance(current, int) or key in ("n_kv_heads", "ffn_dim"):
            changes[key] = int(value)
        elif isinstance(current, float):
            changes[key] = float(value)
        else:
            changes[key] = value
    return args.replace(**changes) if changes else args


def add_common_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, help="model preset (see `scaletrain models`), or a "
                   "Hugging Face config.json or model folder")
    p.add_argument("--set", action="append", default=[], metavar="model.FIELD=VALUE",
                   help="override a model dimension (repeatable)")
    p.add_argument("--seq-len", type=positive_int, default=None, help="tokens per sequence "
                   "(default: train's data.seq_len)")
    p.add_argument("--precision", choices=["auto", "fp32", "bf16", "fp16"], default="auto",
                   help="autocast dtype (default auto: what train's precision.dtype picks on "
                        "--gpu, or on this machine without it)")
    p.add_argument("--param-dtype", choices=["fp32", "bf16", "fp16"], default=None,
                   help="dtype parameters are stored in (default: train's "
                        "precision.param_dtype, fp32: autocast over fp32 parameters); bf16: "
                        "16-bit parameters with sharded fp32 masters, the ZeRO paper's setup "
                        "(train --precision.param_dtype bf16)")
    p.add_argument("--grad-convention", choices=["playbook", "megatron", "bf16"],
                   default=None, help="gradient bytes of 16-bit parameters: 2+4, 4 or 2 "
                   "(default: what the trainer keeps: 4, its fp32 sums; 2 on the device with "
                   "the optimizer offloaded)")
    p.add_argument("--optimizer", choices=["adamw", "sgd", "adamw8bit", "adafactor"],
                   default=None, help="default: train's optimizer.name")
    p.add_argument("--kernels", choices=["auto", "cuda", "cpu"], default="auto",
                   help="whose saved tensors to model (CPU keeps one more tensor per RMSNorm); "
                        "cpu without --gpu plans a CPU run, which also counts the process's own "
                        "memory and its batches (as train --dry-run on a CPU does); default "
                        "auto: cuda with --gpu, else the device train would run on here")
    p.add_argument("--gpu", default=None, help="device name (A100-40GB, A100-80GB, H100, H200, "
                                               "B200, ...)")
    p.add_argument("--gpu-mem", type=float, default=None, help="override device memory (GiB)")
    p.add_argument("--json", action="store_true", help="print JSON")


def resolve_precision(choice: str, cfg: Config, device: Device | None) -> str:
    """`--precision`, with `auto` resolved as the trainer resolves `precision.dtype auto`: bf16
    on a GPU that has it (a device-table entry with a bf16 rate; a custom --gpu-mem device is
    taken to be one), else fp32; without --gpu, on this machine's device (CUDA, or a CPU: bf16
    only with AVX-512 bf16)."""
    if choice != "auto":
        return choice
    if cfg.precision.dtype != "auto":
        return cfg.precision.dtype
    if device is not None:
        return "bf16" if "bf16" in device.peak_tflops or not device.peak_tflops else "fp32"
    from scaletrain.runtime import resolve_device, resolve_dtype

    return resolve_dtype(cfg.precision, resolve_device(cfg.training.device))


def resolve_kernels(choice: str, cfg: Config, device: Device | None) -> str:
    """`--kernels`, with `auto` resolved to the device the plan is for: cuda with --gpu (or
    --gpu-mem), else the device `scaletrain train` would run on this machine (its
    `training.device`, resolved as the trainer resolves it): cpu where there is no CUDA."""
    if choice != "auto":
        return choice
    if device is not None:
        return "cuda"
    from scaletrain.runtime import resolve_device

    return "cuda" if resolve_device(cfg.training.device).type == "cuda" else "cpu"


def fill_train_defaults(a: argparse.Namespace, cfg: Config, offload: bool = False) -> None:
    """Set every common option left unset to what `scaletrain train` runs by default: the
    parameter dtype and optimizer read from `cfg` (the trainer's own default config, not
    restated here), the gradient convention the trainer keeps for them (`offload`: the
    optimizer state in host memory)."""
    from scaletrain.plan.from_config import trainer_grad_convention

    if a.param_dtype is None:
        a.param_dtype = cfg.precision.param_dtype
    if a.optimizer is None:
        a.optimizer = cfg.optimizer.name
    if a.grad_convention is None:
        a.grad_convention = trainer_grad_convention(a.param_dtype, offload)


def parse_device(name: str | None, mem: float | None) -> Device | None:
    if name is None:
        return None if mem is None else Device("custom", mem)
    dev = get_device(name)
    return dataclasses.replace(dev, memory_gib=mem) if mem is not None else dev
