from __future__ import annotations

import pytest
import torch

from scaletrain.config import ActivationCheckpointConfig
from scaletrain.models.args import ModelArgs
from scaletrain.models.transformer import build_model
from scaletrain.parallel.activation_checkpoint import apply_ac
from scaletrain.train.loss import cross_entropy_sum


def _grads_and_saved_bytes(args: ModelArgs, ac: ActivationCheckpointConfig,
                           tokens: torch.Tensor) -> tuple[dict[str, torch.Tensor], float, int]:
    model = build_model(args, seed=3)
    wrapped = apply_ac(model, ac)
    saved = 0

    def pack(t: torch.Tensor) -> torch.Tensor:
        nonlocal saved
        saved += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = cross_entropy_sum(model(tokens[:, :-1]), tokens[:, 1:])
    loss.backward()
    # state_dict names: the wrapper's own prefix is stripped there
    names = {id(p): n for n, p in model.state_dict(keep_vars=True).items()}
    grads = {names[id(p)]: p.grad.clone() for p in model.parameters()}
    return grads, saved, wrapped


@pytest.mark.parametrize(
    "ac",
    [
        ActivationCheckpointConfig(mode="full"),
        ActivationCheckpointConfig(mode="partial", every=2),
        ActivationCheckpointConfig(mode="partial", every=1, scope="attention"),
    ],
    ids=["full", "every-2nd", "attention"],
)
def test_checkpointing_keeps_gradients_and_saves_fewer_bytes(
    ac: ActivationCheckpointConfig,
) -> None:
    args = ModelArgs(dim=64, n_layers=4, n_heads=4, n_kv_heads=2, vocab_size=128, ffn_dim=96,
                     max_seq_len=64)
    tokens = torch.randint(0, 128, (4, 33))
    plain, plain_bytes, _ = _grads_and_saved_bytes(args, ActivationCheckpointConfig(), tokens)
    ckpt, ckpt_bytes, wrapped = _grads_and_saved_bytes(args, ac, tokens)
    assert wrapped > 0
    assert plain.keys() == ckpt.keys()  # parameter names do not change
    for name in plain:
        torch.testing.assert_close(ckpt[name], plain[name], rtol=0, atol=1e-6, msg=name)
    assert ckpt_bytes < plain_bytes


def test_full_saves_less_than_partial() -> None:
    args = ModelArgs(dim=64, n_layers=4, n_heads=4, vocab_size=128, ffn_dim=96, max_seq_len=64)
    tokens = torch.randint(0, 128, (4, 33))
    _, full, _ = _grads_and_saved_bytes(args, ActivationCheckpointConfig(mode="full"), tokens)
    _, half, _ = _grads_and_saved_bytes(
        args, ActivationCheckpointConfig(mode="partial", every=2), tokens
    )
    assert full < half


@pytest.mark.parametrize("scope", ["block", "attention"])
def test_recomputation_replays_the_dropout_masks_of_forward(scope: str) -> None:
    """LoRA dropout inside a checkpointed block: backward's recomputation must draw the masks
    forward drew, so the gradients equal those without recomputation (from the same RNG
    state); other masks would pair one forward with another backward."""
    from scaletrain.finetune.lora import LoRASettings, apply_lora

    args = ModelArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=128, ffn_dim=96,
                     max_seq_len=64)
    tokens = torch.randint(0, 128, (4, 33), generator=torch.Generator().manual_seed(0))
    grads = []
    for ac in (ActivationCheckpointConfig(),
               ActivationCheckpointConfig(mode="partial", every=1, scope=scope)):
        model = build_model(args, seed=3)
        apply_lora(model, LoRASettings(rank=4, alpha=8, dropout=0.3))
        for name, p in model.named_parameters():  # B starts at zero: give it a value
            if "lora_B" in name:
                torch.nn.init.normal_(p, std=0.1, generator=torch.Generator().manual_seed(1))
        apply_ac(model, ac)
        torch.manual_seed(5)
        cross_entropy_sum(model(tokens[:, :-1]), tokens[:, 1:]).backward()
        names = {id(p): n for n, p in model.state_dict(keep_vars=True).items()}
        grads.append({names[id(p)]: p.grad for p in model.parameters() if p.grad is not None})
    assert grads[0].keys() == grads[1].keys() and grads[0]
    for name, g in grads[0].items():
        torch.testing.assert_close(grads[1][name], g, rtol=0, atol=1e-6, msg=name)
