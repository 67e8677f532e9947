"""FSDP under pipeline parallelism holds, at the end of a stage's last backward, the whole
stage's weights gathered and its gradients unsharded: torch's schedules skip FSDP's gradient
reduction and resharding after each backward and reduce once, after the last
(`perform_reduce_grad`). The planner counts both (`Layout.grads_stay_unsharded`): the bytes the
rank holds there, measured on FSDP's own parameters, equal the plan's `gathered_weights` and
`gradients` of its stage (PP 2 x FSDP 2 on 4 gloo ranks: 1F1B and Interleaved1F1B, fp32;
1F1B gathering bf16 weights, with gradients in fp32 and in bf16)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn

from tests.helpers.dist_worker import BASE, MODEL, train_steps
from tests.helpers.proc import run_ranks
from tests.helpers.trainer import tiny_config

# name: schedule flags; the bf16 runs gather 16-bit weights and accumulate the gradients in
# FSDP's reduce dtype (fp32, or bf16)
SCHEDULES = {
    "1F1B": ["--parallel.pp_schedule", "1F1B"],
    "Interleaved1F1B": ["--parallel.pp_schedule", "Interleaved1F1B",
                        "--parallel.pp_virtual_stages", "2"],
    "1F1B bf16 gather": ["--parallel.pp_schedule", "1F1B", "--parallel.fsdp_param_dtype", "bf16"],
    "1F1B bf16 reduce": ["--parallel.pp_schedule", "1F1B", "--parallel.fsdp_param_dtype", "bf16",
                         "--parallel.fsdp_reduce_dtype", "bf16"],
}


def _flags(schedule: str) -> list[str]:
    return [*MODEL, *BASE, "--parallel.pp", "2", "--parallel.dp_shard", "2",
            "--parallel.data_parallel", "zero3", *SCHEDULES[schedule],
            "--training.grad_accum_steps", "4", "--training.steps", "2"]


def _held(module: nn.Module) -> tuple[int, int]:
    """Bytes of FSDP's unsharded parameters allocated now, and of its unsharded gradients."""
    from torch.distributed.fsdp import FSDPModule, fully_shard

    weights = grads = 0
    for unit in module.modules():
        if not isinstance(unit, FSDPModule):
            continue
        group = fully_shard.state(unit)._fsdp_param_group
        for p in group.fsdp_params if group is not None else []:
            unsharded = getattr(p, "_unsharded_param", None)
            if unsharded is None:
                continue
            weights += unsharded.untyped_storage().size()
            acc = getattr(p, "unsharded_accumulated_grad", None)
            grad = acc if acc is not None else unsharded.grad
            grads += 0 if grad is None else grad.untyped_storage().size()
    return weights, grads


def _held_at_reduction(trainer: object) -> list[tuple[int, int]]:
    """`_held` of each stage (chunk) of the rank just before its gradients are reduced, in
    one training step."""
    import torch.distributed.pipelining.stage as stage_lib

    held: list[tuple[int, int]] = []
    reduce_grad = stage_lib._PipelineStageBase.perform_reduce_grad

    def measuring(stage, *args, **kwargs):  # type: ignore[no-untyped-def]
        held.append(_held(stage.submod))
        return reduce_grad(stage, *args, **kwargs)

    stage_lib._PipelineStageBase.perform_reduce_grad = measuring
    try:
        train_steps(trainer, 1, None)
    finally:
        stage_lib._PipelineStageBase.perform_reduce_grad = reduce_grad
    return held


def _entry(rank: int, world: int, out_dir: str, cache: str) -> None:
    from scaletrain.train.trainer import Trainer

    dist.init_process_group("gloo", rank=rank, world_size=world)
    out = {}
    for schedule in SCHEDULES:
        trainer = Trainer(tiny_config(Path(out_dir) / schedule, Path(cache), *_flags(schedule)))
        out[schedule] = _held_at_reduction(trainer)
        dist.barrier()
    torch.save(out, Path(out_dir) / f"rank{rank}.pt")


@pytest.mark.distributed
def test_pp_fsdp_holds_its_stage_gathered_with_unsharded_gradients(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from scaletrain.config import load_config
    from scaletrain.plan.from_config import estimate_for_config
    from tests.helpers.trainer import tiny_argv

    cache = tmp_path / "cache"
    cache.mkdir()
    run_ranks(_entry, 4, str(tmp_path), str(cache))
    monkeypatch.setenv("WORLD_SIZE", "4")
    for schedule in SCHEDULES:
        cfg = load_config(tiny_argv(tmp_path / "plan", cache, *_flags(schedule)))
        plan = estimate_for_config(cfg)
        for rank in range(4):  # ranks 0, 1 run pipeline rank 0; ranks 2, 3 pipeline rank 1
            held = torch.load(tmp_path / f"rank{rank}.pt")[schedule]
            weights, grads = (sum(h[i] for h in held) for i in (0, 1))
            stage = plan["stages"][rank // 2]["memory_bytes"]
            assert weights == pytest.approx(stage["gathered_weights"], rel=0.01), (schedule, rank)
            assert grads == pytest.approx(stage["gradients"], rel=0.01), (schedule, rank)
