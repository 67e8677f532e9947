"""The arguments `scaletrain plan` and `scaletrain plan search` share: the model (a preset or a
Hugging Face config, with `--set` overrides), precision, optimizer and device."""

from __future__ import annotations

import argparse
import dataclasses

from scaletrain.models.args import ModelArgs
from scaletrain.models.source import load_model_args
from scaletrain.plan.estimate import PlanError
from scaletrain.plan.hardware import Device, get_device

GIB, GB = 2**30, 1e9


def positive_int(value: str) -> int:
    n = int(value)
    if n <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer (got {value})")
    return n


def parse_model(name: str, sets: list[str]) -> ModelArgs:
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
    p.add_argument("--seq-len", type=positive_int, required=True, help="tokens per sequence")
    p.add_argument("--precision", choices=["fp32", "bf16", "fp16"], default="bf16")
    p.add_argument("--param-dtype", choices=["fp32", "bf16", "fp16"], default=None,
                   help="dtype parameters are stored in (default: 16-bit with fp32 masters "
                        "for 16-bit precision)")
    p.add_argument("--grad-convention", choices=["playbook", "megatron", "bf16"],
                   default="playbook", help="gradient bytes under mixed precision: 2+4, 4 or 2")
    p.add_argument("--optimizer", choices=["adamw", "sgd", "adamw8bit"], default="adamw")
    p.add_argument("--kernels", choices=["cuda", "cpu"], default="cuda",
                   help="whose saved tensors to model (CPU keeps one more tensor per RMSNorm)")
    p.add_argument("--gpu", default=None, help="device name (A100-40GB, A100-80GB, H100, H200, "
                                               "B200, ...)")
    p.add_argument("--gpu-mem", type=float, default=None, help="override device memory (GiB)")
    p.add_argument("--json", action="store_true", help="print JSON")


def parse_device(name: str | None, mem: float | None) -> Device | None:
    if name is None:
        return None if mem is None else Device("custom", mem)
    dev = get_device(name)
    return dataclasses.replace(dev, memory_gib=mem) if mem is not None else dev
