"""The planner's defaults are the trainer's (autocast over fp32 parameters, `precision.param_dtype`
read from its config), and the ZeRO tables' setup the trainer also runs is one flag away:
16-bit parameters with fp32 masters under every ZeRO stage with several processes (the README's
ZeRO-1 example with `--param-dtype bf16`), fp32 gradient sums (`megatron`), and a tied head
under pipeline parallelism; what stays refused is named."""

from __future__ import annotations

from scaletrain.config_sections import PrecisionConfig
from scaletrain.models.args import get_preset
from scaletrain.parallel.dims import ParallelDims
from scaletrain.plan.estimate import estimate
from scaletrain.plan.layout import Layout


def test_a_default_layout_plans_the_trainers_parameter_dtype() -> None:
    lay = Layout(dims=ParallelDims(dp_shard=8), zero=1, seq_len=4096)
    assert lay.stored_dtype == PrecisionConfig().param_dtype == "fp32"
    plan = estimate(get_preset("llama3-8b"), lay)
    n, mem = plan.params_per_rank, plan.memory_bytes
    # fp32 weights and gradients, Adam's 8 B over 8 ranks, no masters; bf16 autocast copies
    assert (mem["weights"], mem["gradients"], mem["master_weights"]) == (4 * n, 4 * n, 0)
    assert mem["cast_weights"] == 2 * n and plan.trainer_problems == []


def test_readme_zero1_example_is_a_layout_the_trainer_runs() -> None:
    args = get_preset("llama3-8b")
    plan = estimate(args, Layout(dims=ParallelDims(dp_shard=8), zero=1, seq_len=4096,
                                 param_dtype="bf16"))
    lay = plan.layout
    assert (lay.stored_dtype, lay.grad_convention) == ("bf16", "megatron")
    assert plan.trainer_problems == []
    n, mem = plan.params_per_rank, plan.memory_bytes
    # 2 (bf16) + 4 (fp32 sums) + (4 + 8) / 8 bytes per parameter
    assert (mem["weights"], mem["gradients"]) == (2 * n, 4 * n)
    assert (mem["master_weights"], mem["optimizer"]) == (4 * n // 8, 8 * n // 8)


def test_every_zero_stage_with_bf16_parameters_runs_and_fsdp_keeps_no_16bit_copy() -> None:
    args = get_preset("llama3-8b")
    for zero in range(4):
        dims = ParallelDims(dp_replicate=8) if zero == 0 else ParallelDims(dp_shard=8)
        plan = estimate(args, Layout(dims=dims, zero=zero, seq_len=4096, param_dtype="bf16"))
        assert plan.trainer_problems == [], (zero, plan.trainer_problems)
        # FSDP (ZeRO-2/3): its fp32 shards are the masters, gathered in bf16
        assert (plan.memory_bytes["weights"] == 0) == (zero >= 2)
        assert plan.layout.gather_dtype == "bf16"


def test_fp16_precision_plans_fp32_parameters_as_the_trainer_runs_them() -> None:
    plan = estimate(get_preset("debug"), Layout(precision="fp16", seq_len=256))
    assert plan.layout.stored_dtype == "fp32" and plan.trainer_problems == []


def test_tied_head_pipelines_except_zbv_under_fsdp() -> None:
    args = get_preset("llama3.2-1b")
    assert args.tie_embeddings
    pp = Layout(dims=ParallelDims(pp=2, dp_shard=4), zero=1, seq_len=4096, gbs=32)
    assert estimate(args, pp).trainer_problems == []
    zbv = pp.replace(zero=3, schedule="ZBVZeroBubble", vpp=2)
    problems = estimate(args, zbv).trainer_problems
    assert len(problems) == 1 and "ZBVZeroBubble" in problems[0], problems
    assert estimate(args, zbv.replace(zero=1)).trainer_problems == []
