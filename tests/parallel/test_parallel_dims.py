import pytest

from scaletrain.models.args import get_preset
from scaletrain.parallel.dims import ParallelDims, ParallelDimsError


def test_minus_one_takes_the_rest() -> None:
    dims = ParallelDims.resolve(8, tp=2, dp_shard=-1)
    assert dims.dp_shard == 4 and dims.dp == 4 and dims.world_size == 8
    assert list(dims.mesh_shape) == ["pp", "dp_replicate", "dp_shard", "cp", "tp"]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(world_size=8, tp=3, dp_shard=-1), "not divisible"),
        (dict(world_size=8, tp=2, dp_shard=2), "multiply to 4"),
        (dict(world_size=8, tp=-1, dp_shard=-1), "only one"),
        (dict(world_size=8, tp=0), "positive or -1"),
    ],
)
def test_bad_layouts(kwargs: dict, message: str) -> None:
    with pytest.raises(ParallelDimsError, match=message):
        ParallelDims.resolve(**kwargs)


def test_model_problems_name_what_does_not_divide() -> None:
    args = get_preset("debug").replace(n_heads=6, n_kv_heads=2, dim=384)
    problems = ParallelDims(tp=4).model_problems(args, seq_len=256)
    assert any("n_heads (6)" in p for p in problems)
    assert any("n_kv_heads (2)" in p for p in problems)
    assert ParallelDims(tp=2).model_problems(args, seq_len=256) == []
    assert ParallelDims(cp=3).model_problems(args, seq_len=256)
    assert ParallelDims(pp=4).model_problems(args.replace(n_layers=2), seq_len=256)


def test_expert_parallel_degree_is_checked_with_its_fix() -> None:
    from scaletrain.models.args import get_preset
    from scaletrain.parallel.dims import ParallelDims, ParallelDimsError
    from scaletrain.parallel.feasibility import RunLayout, layout_problems

    moe, dense = get_preset("debug-moe"), get_preset("debug")
    with pytest.raises(ParallelDimsError, match="must divide"):
        ParallelDims.resolve(4, dp_shard=4, ep=3)
    dims = ParallelDims.resolve(4, dp_shard=4, ep=2)
    assert dims.dp == 4 and dims.dp_shard_mod_ep == 2 and dims.world_size == 4

    def problems(args, dims, mode="zero3"):  # type: ignore[no-untyped-def]
        return " ".join(layout_problems(args, RunLayout(dims=dims, mode=mode, seq_len=64,
                                                        grad_accum=2)))

    assert problems(moe, dims) == ""
    assert "Mixture-of-Experts" in problems(dense, dims)
    assert "zero2 or zero3" in problems(moe, dims, "ddp")
    assert "n_experts (8) must be divisible by parallel.ep" in problems(
        moe, ParallelDims.resolve(16, dp_shard=16, ep=16))
    # EP x TP: the experts split over both degrees (parallel/ep_tp.py)
    assert problems(moe, ParallelDims.resolve(4, dp_shard=2, tp=2, ep=2)) == ""
    assert problems(moe, ParallelDims.resolve(8, dp_shard=4, tp=2, ep=2)) == ""
    assert "divisible by parallel.ep x parallel.tp (4 x 4)" in problems(
        moe, ParallelDims.resolve(16, dp_shard=4, tp=4, ep=4))
    assert "zero2 or zero3" in problems(moe, ParallelDims.resolve(4, dp_shard=2, tp=2, ep=2),
                                        "zero1")
    assert "without pipeline parallelism" in problems(
        moe, ParallelDims.resolve(8, pp=2, dp_shard=2, tp=2, ep=2))
    assert problems(moe, ParallelDims.resolve(2, dp_shard=1, tp=2)) == ""  # experts over TP


def test_pipeline_schedules_name_too_few_micro_batches() -> None:
    """torch's 1F1B refuses fewer micro-batches than stages: the layout check says so first
    (GPipe runs them)."""
    from scaletrain.models.args import get_preset
    from scaletrain.parallel.dims import ParallelDims
    from scaletrain.parallel.feasibility import RunLayout, layout_problems

    dims = ParallelDims.resolve(2, pp=2)

    def problems(schedule: str, ga: int) -> str:
        return " ".join(layout_problems(get_preset("debug"), RunLayout(
            dims=dims, mode="ddp", seq_len=64, grad_accum=ga, pp_schedule=schedule)))

    assert "1F1B needs at least parallel.pp (2) micro-batches per step, got 1" in problems(
        "1F1B", 1)
    assert problems("1F1B", 2) == "" and problems("GPipe", 1) == ""


def test_micro_batch_aux_scope_is_refused_where_it_drifts_from_one_process() -> None:
    """Scope micro_batch with data or context parallelism and accumulation drifted from one
    process after the first step (docs/moe.md); the feasibility check refuses it there, with
    the fix, and accepts it without accumulation, in one process, and the default scope."""
    from scaletrain.parallel.feasibility import RunLayout, layout_problems

    mb = get_preset("debug-moe").replace(moe_aux_loss_coef=0.01, moe_aux_loss_scope="micro_batch")

    def problems(args, dims, ga):  # type: ignore[no-untyped-def]
        return " ".join(layout_problems(args, RunLayout(dims=dims, mode="zero3", seq_len=64,
                                                        grad_accum=ga)))

    dp2, cp2 = ParallelDims.resolve(2, dp_shard=2), ParallelDims.resolve(2, dp_shard=1, cp=2)
    for dims in (dp2, cp2):
        assert "use the default scope sequence" in problems(mb, dims, 2)
        assert problems(mb, dims, 1) == ""
        assert problems(mb.replace(moe_aux_loss_scope="sequence"), dims, 2) == ""
    assert problems(mb, ParallelDims.resolve(2, dp_shard=1, tp=2), 4) == ""
