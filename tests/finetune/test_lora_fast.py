"""LoRA fast path: same numbers as the reference formula, and no extra full-size activation."""

from __future__ import annotations

import pytest
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


class _SubclassedLinear(nn.Linear):
    """Not exactly nn.Linear: LoRALinear composes it with autograd (the reference path)."""


def _pair(bias: bool, seed: int = 0) -> tuple[LoRALinear, LoRALinear]:
    """The same adapter twice: fused (plain nn.Linear base) and composed (subclass base)."""
    torch.manual_seed(seed)
    plain = nn.Linear(64, 96, bias=bias)
    other = _SubclassedLinear(64, 96, bias=bias)
    other.load_state_dict(plain.state_dict())
    fused, composed = LoRALinear(plain, 4, 8.0), LoRALinear(other, 4, 8.0)
    with torch.no_grad():
        fused.lora_B.weight.normal_()
        composed.load_state_dict(fused.state_dict())
    return fused, composed


def _run(layer: LoRALinear, x: torch.Tensor, dtype: torch.dtype | None
         ) -> tuple[torch.Tensor, list[torch.Tensor]]:
    x = x.detach().clone().requires_grad_(True)
    with torch.autocast("cpu", dtype=dtype or torch.float32, enabled=dtype is not None):
        y = layer(x)
    y.float().square().sum().backward()
    grads = [x.grad] + [p.grad for p in layer.parameters() if p.requires_grad]
    return y.detach(), grads


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("train_base", [False, True])
def test_fused_lora_equals_the_composed_layer(bias: bool, train_base: bool) -> None:
    fused, composed = _pair(bias)
    assert "LoRALinearFunction" in type(fused(torch.randn(2, 64)).grad_fn).__name__
    assert "LoRALinearFunction" not in type(composed(torch.randn(2, 64)).grad_fn).__name__
    if train_base:  # the fused node also serves a trainable base (weight and bias gradients)
        fused.base.requires_grad_(True)
        composed.base.requires_grad_(True)
    x = torch.randn(3, 5, 64)
    y, grads = _run(fused, x, None)
    y_ref, grads_ref = _run(composed, x, None)
    torch.testing.assert_close(y, y_ref, rtol=1e-6, atol=1e-6)
    assert len(grads) == len(grads_ref) == 3 + (1 + bias if train_base else 0)
    for g, r in zip(grads, grads_ref, strict=True):
        torch.testing.assert_close(g, r, rtol=1e-6, atol=1e-5)


def test_fused_lora_under_bf16_autocast_keeps_no_weight_copy() -> None:
    fused, composed = _pair(bias=True)
    x = torch.randn(4, 32, 64)
    y, grads = _run(fused, x, torch.bfloat16)
    y_ref, grads_ref = _run(composed, x, torch.bfloat16)
    assert y.dtype == y_ref.dtype == torch.bfloat16
    torch.testing.assert_close(y, y_ref, rtol=2e-2, atol=2e-2)
    for g, r in zip(grads, grads_ref, strict=True):  # bf16 rounding: relative to the norm
        assert g.dtype == r.dtype
        assert float((g - r).float().norm() / r.float().norm()) < 1e-2

    def saved(layer: LoRALinear) -> int:  # every saved tensor, cast weight copies included
        seen: dict[int, int] = {}
        params = {p.untyped_storage().data_ptr() for p in layer.parameters()}

        def pack(t: torch.Tensor) -> torch.Tensor:
            if t.untyped_storage().data_ptr() not in params:
                seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t

        xb = x.to(torch.bfloat16).requires_grad_(True)
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), \
                torch.autocast("cpu", dtype=torch.bfloat16):
            layer(xb)
        return sum(seen.values())

    r_wide = 4 * 32 * 4 * 2
    weight_copy = 96 * 64 * 2
    assert saved(fused) <= x.numel() * 2 + r_wide
    assert saved(composed) >= x.numel() * 2 + weight_copy  # autocast keeps the bf16 weight


def test_fused_qlora_equals_bitsandbytes_layer_with_adapter() -> None:
    pytest.importorskip("bitsandbytes")
    from scaletrain.finetune.qlora import to_nf4

    torch.manual_seed(0)
    dense = nn.Linear(128, 96, bias=True)
    fused = LoRALinear(to_nf4(dense, torch.float32), 4, 8.0)
    with torch.no_grad():
        fused.lora_B.weight.normal_()
    x = torch.randn(2, 7, 128)
    assert "LoRALinearFunction" in type(fused(x.clone().requires_grad_(True)).grad_fn).__name__
    y, grads = _run(fused, x, None)
    # reference: bitsandbytes' own layer (it dequantizes inside) plus the adapter, by autograd
    a = fused.lora_A.weight.detach().clone().requires_grad_(True)
    b = fused.lora_B.weight.detach().clone().requires_grad_(True)
    x2 = x.clone().requires_grad_(True)
    ref = fused.base(x2) + fused.scaling * (x2 @ a.T @ b.T)
    ref.square().sum().backward()
    torch.testing.assert_close(y, ref.detach(), rtol=1e-5, atol=1e-5)
    for g, r in zip(grads, (x2.grad, a.grad, b.grad), strict=True):
        torch.testing.assert_close(g, r, rtol=1e-5, atol=1e-4)
