"""The activation estimate against what autograd actually saves on CPU (within 5 %)."""

from __future__ import annotations

import pytest

from scaletrain.config import ActivationCheckpointConfig as AC
from scaletrain.models.args import PRESETS, ModelArgs
from scaletrain.plan.memory.activations import ActivationSpec, activation_bytes
from scaletrain.train.saved_bytes import measure_saved_bytes

SHAPES = {
    "gqa": ModelArgs(dim=64, n_layers=3, n_heads=4, n_kv_heads=2, vocab_size=128, ffn_dim=96,
                     max_seq_len=128),
    "mha-wide-ffn": ModelArgs(dim=96, n_layers=2, n_heads=6, vocab_size=200, ffn_dim=320,
                              max_seq_len=128),
    "tied": ModelArgs(dim=64, n_layers=4, n_heads=8, n_kv_heads=1, vocab_size=64, ffn_dim=128,
                      max_seq_len=128, tie_embeddings=True),
    "gpt2": ModelArgs(arch="gpt2", dim=64, n_layers=2, n_heads=4, vocab_size=96, max_seq_len=128),
}
# q/k norms; post-norms, soft-capped explicit attention, windows and capped logits
FAMILY_SHAPES = {fam: PRESETS[f"debug-{fam}"].replace(
    dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=128, ffn_dim=96, head_dim_override=24)
    for fam in ("qwen3", "gemma2")}
FAMILY_SHAPES["moe"] = PRESETS["debug-moe"].replace(
    dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=128, ffn_dim=96, n_experts=4,
    n_experts_per_token=2, moe_ffn_dim=48, moe_aux_loss_coef=0.01)
FAMILY_SHAPES["moe-shared"] = FAMILY_SHAPES["moe"].replace(
    n_experts=8, n_experts_per_token=3, n_shared_experts=1, router_score="sigmoid")
MODES = {
    "none": AC(),
    "full": AC(mode="full"),
    "every-2nd": AC(mode="partial", every=2),
    "every-3rd": AC(mode="partial", every=3),
    "attention": AC(mode="partial", every=1, scope="attention"),
}
PRECISIONS = {"fp32": ("fp32", "fp32"), "autocast": ("bf16", "fp32"), "bf16": ("bf16", "bf16")}


def _estimate(args: ModelArgs, mbs: int, seq: int, dtype: str, param_dtype: str, ac: AC) -> int:
    spec = ActivationSpec(mbs=mbs, seq_len=seq, compute_dtype=dtype, residual_dtype=param_dtype,
                          recompute=ac.mode, every=ac.every, scope=ac.scope, kernels="cpu")
    return activation_bytes(args, spec).autograd_saved


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("shape", SHAPES)
def test_saved_bytes_match_the_estimate(shape: str, precision: str, mode: str) -> None:
    args, ac = SHAPES[shape], MODES[mode]
    dtype, param_dtype = PRECISIONS[precision]
    for mbs, seq in ((2, 16), (3, 40)):
        measured = measure_saved_bytes(args, mbs, seq, dtype, param_dtype, ac).activations
        estimate = _estimate(args, mbs, seq, dtype, param_dtype, ac)
        assert estimate == pytest.approx(measured, rel=0.05), (mbs, seq)


@pytest.mark.parametrize("mode", ["none", "every-2nd"])
@pytest.mark.parametrize("precision", ["fp32", "autocast"])
@pytest.mark.parametrize("shape", FAMILY_SHAPES)
def test_family_saved_bytes_match_the_estimate(shape: str, precision: str, mode: str) -> None:
    args, ac = FAMILY_SHAPES[shape], MODES[mode]
    dtype, param_dtype = PRECISIONS[precision]
    for mbs, seq in ((2, 16), (3, 40)):
        measured = measure_saved_bytes(args, mbs, seq, dtype, param_dtype, ac).activations
        estimate = _estimate(args, mbs, seq, dtype, param_dtype, ac)
        assert estimate == pytest.approx(measured, rel=0.05), (mbs, seq)


def test_recompute_modes_order_and_autocast_copies_are_weights() -> None:
    args = SHAPES["gqa"]
    sizes = {m: measure_saved_bytes(args, 2, 32, "bf16", "fp32", ac)
             for m, ac in MODES.items()}
    assert sizes["full"].activations < sizes["every-2nd"].activations < sizes["none"].activations
    # autocast keeps bf16 copies of the weights for backward: reported apart, not activations
    assert sizes["none"].weight_copies > 0
    assert measure_saved_bytes(args, 2, 32, "fp32", "fp32").weight_copies == 0


def test_estimate_is_linear_in_the_batch_except_shared_tables() -> None:
    args = SHAPES["gqa"]
    one = _estimate(args, 1, 64, "bf16", "bf16", AC())
    two = _estimate(args, 2, 64, "bf16", "bf16", AC())
    fixed = 2 * 64 * args.head_dim * 2 + 4  # RoPE cos/sin tables and the loss's scalar
    assert two - fixed == 2 * (one - fixed)


@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("shape", [*SHAPES, "qwen3", "gemma2", "moe"])
def test_fused_loss_saved_bytes_match_the_estimate(shape: str, precision: str) -> None:
    """The chunked head + loss keeps d loss/d h and d loss/d W instead of logits: counted."""
    args = SHAPES.get(shape) or FAMILY_SHAPES[shape]
    dtype, param_dtype = PRECISIONS[precision]
    for mbs, seq in ((2, 16), (3, 40)):
        measured = measure_saved_bytes(args, mbs, seq, dtype, param_dtype, fused_loss=True,
                                       loss_chunk=7).activations
        spec = ActivationSpec(mbs=mbs, seq_len=seq, compute_dtype=dtype,
                              residual_dtype=param_dtype, kernels="cpu", fused_loss=True,
                              loss_chunk=7)
        assert activation_bytes(args, spec).autograd_saved == pytest.approx(measured, rel=0.01)


def test_fused_loss_in_the_plan_of_a_large_vocabulary() -> None:
    from scaletrain.models.args import get_preset
    from scaletrain.parallel.dims import ParallelDims
    from scaletrain.plan.estimate import estimate
    from scaletrain.plan.layout import Layout

    args = get_preset("llama3-8b")
    lay = Layout(dims=ParallelDims(), mbs=1, seq_len=8192, precision="bf16", param_dtype="bf16")
    plain, fused = estimate(args, lay), estimate(args, lay.replace(fused_loss=True))
    gib = 2**30
    # plain: fp32 log-softmax (4 B x 8192 x 128,256) kept + logits and two fp32 buffers
    assert plain.memory_bytes["logits_loss"] / gib == pytest.approx(10 * 8192 * 128256 / gib)
    # fused: one 1024-token chunk (the default; fp32 logits, fp32 gradient, its bf16 copy)
    assert fused.memory_bytes["logits_loss"] / gib == pytest.approx(10 * 1024 * 128256 / gib)
    assert plain.peak_bytes - fused.peak_bytes > 2 * gib
    larger = estimate(args, lay.replace(fused_loss=True, loss_chunk=4096))
    assert larger.memory_bytes["logits_loss"] == 4 * fused.memory_bytes["logits_loss"]
