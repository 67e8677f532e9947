"""LoRA adapters of every family in PEFT's format: PEFT loads them on transformers' model with
our logits, and our loader reads them back (Phi-3: through the fused qkv/gate_up projections)."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

from scaletrain.finetune.lora import (  # noqa: E402
    LoRASettings,
    adapter_modules,
    apply_lora,
    parse_targets,
)
from scaletrain.finetune.peft_io import AdapterError, load_adapter, save_adapter  # noqa: E402
from scaletrain.models.hf import load_hf_checkpoint  # noqa: E402
from tests.helpers.family import FAMILIES, hf_model, tokens  # noqa: E402

ALL = ("q", "k", "v", "o", "gate", "up", "down")


def _trained_adapter(model: torch.nn.Module, targets: tuple[str, ...]) -> LoRASettings:
    settings = LoRASettings(rank=4, alpha=8.0, dropout=0.0, targets=targets)
    torch.manual_seed(0)
    apply_lora(model, settings)
    with torch.no_grad():  # B = 0 would make the adapter a no-op: stand in for training
        for lora in adapter_modules(model).values():
            lora.lora_B.weight.normal_(std=0.2)
        for name, p in model.named_parameters():
            if name.endswith(("attention_norm.weight", "ffn_norm.weight")) or name == "norm.weight":
                p.add_(0.1 * torch.randn_like(p))
    return settings


@pytest.mark.parametrize("family", list(FAMILIES))
def test_peft_loads_our_adapter_with_equal_logits(tmp_path, family):
    hf = hf_model(family)
    hf.save_pretrained(tmp_path / "base")
    ours, _ = load_hf_checkpoint(tmp_path / "base")
    settings = _trained_adapter(ours, ALL)
    save_adapter(tmp_path / "adapter", ours, settings, base_path=str(tmp_path / "base"),
                 train_norms=True)
    x = tokens(40)
    with torch.no_grad():
        expected = ours(x)
        base = hf(x).logits
    assert (expected - base).abs().max() > 1e-2  # the adapter changes the model
    peft_model = peft.PeftModel.from_pretrained(hf, tmp_path / "adapter").eval()
    with torch.no_grad():
        torch.testing.assert_close(peft_model(x).logits, expected, atol=1e-5, rtol=1e-5)
    again, _ = load_hf_checkpoint(tmp_path / "base")
    load_adapter(tmp_path / "adapter", again)
    with torch.no_grad():
        torch.testing.assert_close(again(x), expected, atol=1e-5, rtol=1e-5)


def test_phi3_adapter_trained_by_peft_loads_and_partial_fused_targets_are_refused(tmp_path):
    hf = hf_model("phi3")
    hf.save_pretrained(tmp_path / "base")
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["qkv_proj", "gate_up_proj"],
                             init_lora_weights=False)
    peft_model = peft.get_peft_model(hf, config).eval()
    peft_model.save_pretrained(tmp_path / "peft")
    ours, _ = load_hf_checkpoint(tmp_path / "base")
    load_adapter(tmp_path / "peft", ours)  # dense rank-4 B on the fused linear
    x = tokens(40)
    with torch.no_grad():
        torch.testing.assert_close(ours(x), peft_model(x).logits, atol=1e-5, rtol=1e-5)
    assert parse_targets("qkv_proj,gate_up_proj,o_proj") == ("q", "k", "v", "gate", "up", "o")
    fresh, _ = load_hf_checkpoint(tmp_path / "base")
    settings = _trained_adapter(fresh, ("q", "v"))
    with pytest.raises(AdapterError, match="fuses q,k,v into qkv_proj"):
        save_adapter(tmp_path / "bad", fresh, settings, base_path="x")


@pytest.mark.parametrize("family", ["qwen2", "gemma2"])
def test_lora_training_step_equals_peft(tmp_path, family):
    """The same adapter (PEFT's, B nonzero) on the same data: equal loss and adapter gradients
    (our fused LoRA node has its own backward)."""
    import torch.nn.functional as F

    from scaletrain.finetune.peft_io import _hf_name

    hf = hf_model(family)
    hf.save_pretrained(tmp_path / "base")
    config = peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, init_lora_weights=False,
                             target_modules=[f"{m}_proj" for m in ALL])
    torch.manual_seed(0)
    theirs = peft.get_peft_model(hf, config)
    theirs.save_pretrained(tmp_path / "adapter")
    ours, args = load_hf_checkpoint(tmp_path / "base")
    load_adapter(tmp_path / "adapter", ours)
    x = tokens(40)

    def loss(logits: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits[:, :-1].flatten(0, 1), x[:, 1:].flatten())

    ref = loss(theirs(x).logits)
    got = loss(ours(x))
    ref.backward()
    got.backward()
    assert abs(got.item() - ref.item()) < 1e-5
    grads = {n: p.grad for n, p in theirs.named_parameters() if p.requires_grad}
    for name, lora in adapter_modules(ours).items():
        for part in ("lora_A", "lora_B"):
            expected = grads[f"base_model.model.{_hf_name(name, args)}.{part}.default.weight"]
            torch.testing.assert_close(getattr(lora, part).weight.grad, expected,
                                       atol=1e-5 * expected.abs().max().item(), rtol=1e-5)
