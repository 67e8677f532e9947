"""Optimizers (AdamW, SGD, Adafactor, 8-bit AdamW) and fp32 master weights / CPU offload."""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from scaletrain.config import ConfigError, OptimizerConfig
from scaletrain.train.optim_state import group_settings, settings_by_name

log = logging.getLogger(__name__)


def param_groups(model: nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """Weight decay on matrices (dim >= 2); none on norms and biases."""
    decay, no_decay = [], []
    for p in _unique_trainable(model.parameters()):
        (decay if p.ndim >= 2 else no_decay).append(p)
    return [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]


def _unique_trainable(params: Iterable[nn.Parameter]) -> list[nn.Parameter]:
    seen: set[int] = set()
    out = []
    for p in params:
        if p.requires_grad and id(p) not in seen:
            seen.add(id(p))
            out.append(p)
    return out


def _kernel_kwargs(cfg: OptimizerConfig, device: torch.device) -> dict[str, bool]:
    """fused/foreach flags: `auto` takes fused kernels on CUDA and CPU (torch >= 2.4)."""
    if cfg.implementation == "fused" or (
        cfg.implementation == "auto" and device.type in ("cuda", "cpu")
    ):
        return {"fused": True}
    if cfg.implementation == "foreach":
        return {"foreach": True}
    if cfg.implementation == "for-loop":
        return {"foreach": False}
    return {}


def make_optimizer(groups: list[dict[str, Any]], cfg: OptimizerConfig,
                   device: torch.device) -> torch.optim.Optimizer:
    """The torch (or bitsandbytes) optimizer named by `cfg.name` over `groups`."""
    if cfg.name == "adamw":
        return torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps,
                                 **_kernel_kwargs(cfg, device))
    if cfg.name == "sgd":
        return torch.optim.SGD(groups, lr=cfg.lr, momentum=cfg.beta1,
                               **_kernel_kwargs(cfg, device))
    if cfg.name == "adafactor":
        return torch.optim.Adafactor(groups, lr=cfg.lr, eps=(None, 1e-3))
    if cfg.name == "adamw8bit":
        try:
            import bitsandbytes as bnb
        except ImportError as e:
            raise ConfigError(
                "optimizer.name adamw8bit needs bitsandbytes: pip install 'scaletrain[quant]'"
            ) from e
        return bnb.optim.AdamW8bit(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps)
    raise ConfigError(f"optimizer.name: unknown optimizer '{cfg.name}'")


class MasterWeightOptimizer:
    """Steps an inner optimizer on fp32 copies of the model's parameters.

    Used for bf16 parameters (the update is applied in fp32, then rounded into the model) and for
    CPU offload (master weights and optimizer state live in host memory; only gradients travel
    down and updated weights travel back). Exposes the small Optimizer surface the trainer uses.

    Gradients of 16-bit parameters accumulate in fp32, as Megatron's "main_grad" buffers do: a
    post-accumulate-grad hook adds each micro-batch's 16-bit `p.grad` into the fp32 gradient of
    the parameter's master (`m.grad`, on the master device) and frees `p.grad`, so the sum over
    the accumulation steps is never rounded to 16 bits. Clipping, the gradient norm and the
    non-finite check read `grad_params()` (the masters for those parameters), the update reads
    the same tensors. fp32 parameters (offload alone) keep accumulating in `p.grad`.
    """

    def __init__(self, model: nn.Module, cfg: OptimizerConfig, master_device: torch.device) -> None:
        self.params = _unique_trainable(model.parameters())
        # state-dict names (wrapper prefixes such as activation checkpointing's are stripped)
        names = {id(p): n for n, p in model.state_dict(keep_vars=True).items()}
        self.names = [names[id(p)] for p in self.params]
        self.masters = [
            p.detach().to(master_device, torch.float32, copy=True).requires_grad_(True)
            for p in self.params
        ]
        by_id = {id(p): m for p, m in zip(self.params, self.masters)}
        groups = [
            {**g, "params": [by_id[id(p)] for p in g["params"]]}
            for g in param_groups(model, cfg.weight_decay)
        ]
        self.inner = make_optimizer(groups, cfg, master_device)
        # Every parameter gets the hook; it acts on 16-bit ones only (the trainer casts the
        # parameters to bf16 after this optimizer copied their fp32 values into the masters).
        self._hooks = [p.register_post_accumulate_grad_hook(self._accumulate_hook(m))
                       for p, m in zip(self.params, self.masters)]

    @staticmethod
    def _accumulate_hook(master: torch.Tensor) -> Any:
        """The hook of one parameter: a 16-bit parameter's fresh gradient goes into
        `master.grad` in fp32 and `p.grad` is freed; an fp32 one stays in `p.grad`."""
        @torch.no_grad()
        def hook(p: torch.Tensor) -> None:
            g = p.grad
            if g is None or p.dtype == torch.float32:
                return
            if master.grad is None:
                master.grad = g.to(master.device, torch.float32, copy=True)
            else:
                master.grad.add_(g.to(master.device))  # upcast inside add_: an fp32 sum
            p.grad = None
        return hook

    def grad_params(self) -> list[torch.Tensor]:
        """The tensors whose `.grad` the step clips and updates with: the fp32 master of each
        16-bit parameter (its accumulated gradient), the parameter itself otherwise."""
        return [p if p.dtype == torch.float32 else m for p, m in zip(self.params, self.masters)]

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.inner.param_groups

    @property
    def state(self) -> dict[Any, Any]:
        """The inner optimizer's state (of the fp32 masters)."""
        return self.inner.state

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p, m in zip(self.params, self.masters):
            p.grad = None
            m.grad = None

    @torch.no_grad()
    def step(self) -> None:
        for p, m in zip(self.params, self.masters):
            if p.dtype == torch.float32:  # 16-bit ones already hold their fp32 sum in m.grad
                m.grad = None if p.grad is None else p.grad.to(m.device, torch.float32)
        self.inner.step()
        for p, m in zip(self.params, self.masters):
            p.copy_(m.to(p.device, non_blocking=True))
            m.grad = None

    def state_dict(self) -> dict[str, Any]:
        """Optimizer state keyed by parameter name (as DCP expects), plus the fp32 masters."""
        inner = self.inner.state_dict()
        return {
            "master": dict(zip(self.names, self.masters)),
            "state": {self.names[i]: s for i, s in inner["state"].items()},
            "param_groups": settings_by_name(inner["param_groups"], self.group_names()),
        }

    def group_names(self) -> list[list[str]]:
        """The names of each parameter group's parameters."""
        names = {id(m): n for m, n in zip(self.masters, self.names, strict=True)}
        return [[names[id(m)] for m in g["params"]] for g in self.inner.param_groups]

    def load_state_dict(self, state: dict[str, Any]) -> None:
        index = {n: i for i, n in enumerate(self.names)}
        with torch.no_grad():
            for name, m in zip(self.names, self.masters):
                m.copy_(state["master"][name])
            for p, m in zip(self.params, self.masters):
                p.copy_(m)
        inner = self.inner.state_dict()["param_groups"]
        saved = group_settings(state["param_groups"], self.group_names())
        self.inner.load_state_dict({
            "state": {index[n]: s for n, s in state["state"].items()},
            "param_groups": [{**s, "params": g["params"]}
                             for s, g in zip(saved, inner, strict=True)],
        })

    def init_state(self) -> None:
        """Create empty optimizer state so a checkpoint can be loaded into it."""
        create_state(self.inner)


def create_state(optimizer: torch.optim.Optimizer) -> None:
    """Give every parameter of `optimizer` its state (a zero-learning-rate step on zero
    gradients, which leaves the parameters as they are), so a checkpoint can be loaded into
    it; the gradients are cleared again."""
    params = [p for g in optimizer.param_groups for p in g["params"]]
    for p in params:
        p.grad = torch.zeros_like(p)
    saved = [g["lr"] for g in optimizer.param_groups]
    for g in optimizer.param_groups:
        g["lr"] = 0.0
    optimizer.step()
    for g, lr in zip(optimizer.param_groups, saved, strict=True):
        g["lr"] = lr
    for p in params:
        p.grad = None


def build_optimizer(model: nn.Module, cfg: OptimizerConfig, device: torch.device,
                    param_dtype: str) -> torch.optim.Optimizer | MasterWeightOptimizer:
    """A plain optimizer for fp32 parameters on the device; master weights otherwise."""
    if param_dtype == "fp32" and not cfg.offload:
        return make_optimizer(param_groups(model, cfg.weight_decay), cfg, device)
    master_device = torch.device("cpu") if cfg.offload else device
    log.info("optimizer: fp32 master weights on %s", master_device)
    return MasterWeightOptimizer(model, cfg, master_device)
