"""LoRA fast path: same numbers as the reference formula, and no extra full-size activation."""

from __future__ import annotations

import torch
from torch import nn

from scaletrain.finetune.lora import LoRALinear


def _layer(seed: int = 0) -> LoRALinear:
    torch.manual_seed(seed)
    lora = LoRALinear(nn.Linear(64, 96, bias=False), rank=4, alpha=8.0)
    with torch.no_grad():
        lora.lora_B.weight.normal_()  # a non-zero adapter, so its gradients are non-trivial
    return lora


def test_lora_loss_and_grads_equal_reference_formula() -> None:
    lora = _layer()
    x = torch.randn(3, 5, 64, requires_grad=True)
    loss = lora(x).square().sum()
    loss.backward()
    got = (x.grad.clone(), lora.lora_A.weight.grad.clone(), lora.lora_B.weight.grad.clone())
    a = lora.lora_A.weight.detach().clone().requires_grad_(True)
    b = lora.lora_B.weight.detach().clone().requires_grad_(True)
    x2 = x.detach().clone().requires_grad_(True)
    ref = x2 @ lora.base.weight.T + lora.scaling * (x2 @ a.T @ b.T)
    ref_loss = ref.square().sum()
    ref_loss.backward()
    torch.testing.assert_close(loss, ref_loss, rtol=1e-6, atol=1e-6)
    for g, r in zip(got, (x2.grad, a.grad, b.grad), strict=True):
        torch.testing.assert_close(g, r, rtol=1e-6, atol=1e-5)
    assert lora.base.weight.grad is None and not lora.base.weight.requires_grad


def _saved_bytes(layer: nn.Module, fn) -> int:
    """Bytes of the activations autograd keeps (parameters excluded, shared storages once)."""
    params = {p.untyped_storage().data_ptr() for p in layer.parameters()}
    weight_shapes = {s for p in layer.parameters() for s in (tuple(p.shape), tuple(p.shape)[::-1])}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        if t.untyped_storage().data_ptr() not in params and tuple(t.shape) not in weight_shapes:
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return sum(seen.values())


def test_lora_saves_only_base_input_and_r_wide_tensors() -> None:
    """Saved bytes <= the layer input (shared by base and lora_A) + r-wide intermediates."""
    lora = _layer()
    x = torch.randn(4, 32, 64, requires_grad=True)
    saved = _saved_bytes(lora, lambda: lora(x))
    r_wide = 4 * 32 * lora.rank * 4
    assert saved <= x.numel() * 4 + 2 * r_wide, saved
    # under autocast the input comes in bf16 (the previous op's output): both matmuls share it
    xb = x.detach().to(torch.bfloat16).requires_grad_(True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        saved_bf16 = _saved_bytes(lora, lambda: lora(xb))
    assert saved_bf16 <= xb.numel() * 2 + r_wide, saved_bf16


def test_frozen_base_is_outside_the_optimizer_and_gets_no_grad() -> None:
    from scaletrain.train.optim import param_groups

    lora = _layer()
    groups = param_groups(lora, weight_decay=0.1)
    in_optim = {id(p) for g in groups for p in g["params"]}
    assert in_optim == {id(lora.lora_A.weight), id(lora.lora_B.weight)}
    lora(torch.randn(2, 64)).sum().backward()
    assert lora.base.weight.grad is None  # no base-weight gradient is computed or clipped
