"""The fine-tuning activation model against what autograd saves when the fine-tuning code
(`finetune.methods`: freezing, LoRA fused and with dropout, the classification head) is applied
to a fresh model: activations and kept autocast weight copies, byte for byte (up to the one
extra token column of the measured batch: its ids are sliced from (b, s + 1))."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from scaletrain.config import ActivationCheckpointConfig as AC
from scaletrain.finetune.lora import TARGETS, LoRASettings
from scaletrain.finetune.methods import apply_method, with_head
from scaletrain.models.args import ModelArgs
from scaletrain.plan.finetune.activations import (
    finetune_activation_bytes,
    kept_weight_casts,
    method_blocks,
)
from scaletrain.plan.memory.activations import ActivationSpec, activation_bytes
from scaletrain.train.saved_bytes import measure_saved_bytes

SHAPES = {
    "gqa": ModelArgs(dim=64, n_layers=3, n_heads=4, n_kv_heads=2, vocab_size=128, ffn_dim=96,
                     max_seq_len=128),
    "tied": ModelArgs(dim=48, n_layers=4, n_heads=4, n_kv_heads=1, vocab_size=80, ffn_dim=72,
                      max_seq_len=128, tie_embeddings=True),
}
METHODS: dict[str, tuple[str, dict[str, Any]]] = {
    "full": ("full", {}),
    "freeze-first": ("freeze", {"freeze_first": 1}),
    "freeze-none": ("freeze", {}),  # only the embeddings frozen
    "freeze-first-embeddings-train": ("freeze", {"freeze_first": 2, "freeze_embeddings": False}),
    "train-last": ("freeze", {"train_last": 1}),
    "train-last-0": ("freeze", {"train_last": 0}),
    "lora": ("lora", {}),
    "lora-qv": ("lora", {"targets": ("q", "v"), "rank": 3}),
    "lora-o-down": ("lora", {"targets": ("o", "down")}),
    "lora-norms": ("lora", {"train_norms": True, "targets": ("k", "gate")}),
    "lora-dropout": ("lora", {"lora_dropout": 0.1}),
    "lora-dropout-qv-norms": ("lora", {"lora_dropout": 0.1, "targets": ("q", "v"),
                                       "train_norms": True}),
}
PRECISIONS = {"fp32": ("fp32", "fp32"), "autocast": ("bf16", "fp32"), "bf16": ("bf16", "bf16")}


def _hook(method: str, options: dict[str, Any], num_labels: int | None):
    def prepare(model: torch.nn.Module) -> torch.nn.Module:
        lora = LoRASettings(options.get("rank", 4), 16.0, options.get("lora_dropout", 0.0),
                            options.get("targets", tuple(TARGETS)))
        apply_method(model, method, lora=lora,
                     freeze_embeddings=options.get("freeze_embeddings", True),
                     freeze_first=options.get("freeze_first", 0),
                     train_last=options.get("train_last"),
                     norms=options.get("train_norms", False))
        return with_head(model, num_labels)
    return prepare


def _planned(args: ModelArgs, spec: ActivationSpec, method: str, options: dict[str, Any],
             num_labels: int | None) -> tuple[int, int]:
    opts = {k: v for k, v in options.items() if k != "rank"}
    kw = method_blocks(args, method, num_labels=num_labels, **opts)
    kw.update(num_labels=num_labels, rank=options.get("rank", 4))
    return (finetune_activation_bytes(args, spec, **kw).autograd_saved,
            kept_weight_casts(args, spec, **kw))


def _check(args: ModelArgs, method: str, options: dict[str, Any], num_labels: int | None,
           precision: str, ac: AC, sizes: tuple[tuple[int, int], ...],
           fused_loss: bool = False) -> None:
    dtype, param_dtype = PRECISIONS[precision]
    for mbs, seq in sizes:
        measured = measure_saved_bytes(args, mbs, seq, dtype, param_dtype, ac,
                                       fused_loss=fused_loss, loss_chunk=7,
                                       finetune=_hook(method, options, num_labels))
        spec = ActivationSpec(mbs=mbs, seq_len=seq, compute_dtype=dtype,
                              residual_dtype=param_dtype, kernels="cpu", recompute=ac.mode,
                              every=ac.every, scope=ac.scope, fused_loss=fused_loss,
                              loss_chunk=7)
        planned, casts = _planned(args, spec, method, options, num_labels)
        assert 0 <= measured.activations - planned <= 8 * mbs, (mbs, seq)
        assert casts == measured.weight_copies, (mbs, seq)


@pytest.mark.parametrize("num_labels", [None, 3], ids=["lm", "classify"])
@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("shape", SHAPES)
def test_finetune_saved_bytes_equal_the_plan(shape: str, method: str, precision: str,
                                             num_labels: int | None) -> None:
    name, options = METHODS[method]
    sizes = ((2, 16), (3, 40)) if shape == "gqa" else ((3, 24),)
    _check(SHAPES[shape], name, options, num_labels, precision, AC(), sizes)


@pytest.mark.parametrize("mode", [AC(mode="full"), AC(mode="partial", every=2),
                                  AC(mode="partial", every=1, scope="attention")],
                         ids=["full", "every-2nd", "attention"])
@pytest.mark.parametrize("method", ["freeze-first", "train-last", "lora-qv", "lora-dropout"])
def test_finetune_recomputation_equals_the_plan(method: str, mode: AC) -> None:
    name, options = METHODS[method]
    _check(SHAPES["gqa"], name, options, None, "autocast", mode, ((3, 40),))


@pytest.mark.parametrize(("shape", "method", "precision"), [
    ("gqa", "full", "autocast"), ("tied", "train-last", "bf16"), ("gqa", "lora", "autocast"),
    ("tied", "lora-norms", "fp32"), ("gqa", "lora-dropout", "bf16")])
def test_fused_loss_saved_bytes_equal_the_plan(shape: str, method: str, precision: str) -> None:
    """`training.fused_loss`: the chunked head + loss keeps the hidden states' gradient (and
    the head weight's when it trains) instead of logits; the measured bytes drop by the
    planned difference."""
    name, options = METHODS[method]
    _check(SHAPES[shape], name, options, None, precision, AC(), ((3, 24),), fused_loss=True)


def test_fused_loss_keeps_fewer_bytes_than_the_logits() -> None:
    """Measured: a LoRA step with the fused loss saves (tokens x vocabulary) fp32 fewer
    bytes for backward than with logits."""
    args = SHAPES["gqa"]
    plain, fused = (measure_saved_bytes(args, 2, 32, "bf16", "fp32", AC(), fused_loss=f,
                                        finetune=_hook("lora", {}, None)) for f in (False, True))
    saved = plain.activations + plain.weight_copies - fused.activations - fused.weight_copies
    tokens = 2 * 32
    assert saved >= 4 * tokens * args.vocab_size  # the log-softmax, at least


def test_full_language_modelling_is_pretraining() -> None:
    args = SHAPES["gqa"]
    spec = ActivationSpec(mbs=2, seq_len=32, compute_dtype="bf16", kernels="cpu")
    full = finetune_activation_bytes(args, spec, **method_blocks(args, "full"))
    assert full == activation_bytes(args, spec)


def test_the_plan_uses_the_fine_tuning_rule() -> None:
    """`finetune_plan` (plan --method, finetune --dry-run) reports these bytes (recomputation
    included); a classification plan has no (tokens x vocabulary) rows."""
    from scaletrain.parallel.dims import ParallelDims
    from scaletrain.plan.estimate import estimate
    from scaletrain.plan.finetune.plan import finetune_plan
    from scaletrain.plan.layout import Layout

    args = SHAPES["gqa"]
    lay = Layout(dims=ParallelDims(), mbs=2, seq_len=40, precision="bf16", param_dtype="fp32",
                 kernels="cpu", recompute="partial", every=2)
    pre = estimate(args, lay)
    for method, options in METHODS.values():
        for labels in (None, 5):
            plan = finetune_plan(pre, method, num_labels=labels, **options)
            spec = ActivationSpec(mbs=2, seq_len=40, compute_dtype="bf16", kernels="cpu",
                                  recompute="partial", every=2)
            opts = {k: v for k, v in options.items() if k != "rank"}
            kw = method_blocks(args, method, num_labels=labels, **opts)
            kw.update(num_labels=labels, rank=options.get("rank", 8))
            act = finetune_activation_bytes(args, spec, **kw)
            mem = plan.memory_bytes
            if method == "full" and labels is None:
                assert mem == pre.memory_bytes
                continue
            assert mem["activations"] == act.saved + act.recompute
            assert mem["cast_weights"] == kept_weight_casts(args, spec, **kw)
            assert mem["logits_loss"] == (pre.memory_bytes["logits_loss"] if labels is None
                                          else (2 + 8) * 2 * labels)
