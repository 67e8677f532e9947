"""16-bit parameters with sharded fp32 master weights across processes (Megatron's distributed
optimizer, DeepSpeed's ZeRO-1/2 with bf16 weights): `precision.param_dtype bf16` with ZeRO-0/1
(the partitioned optimizer's fp32 masters, `train/zero1.py`), alone and with TP or PP, and with
ZeRO-2/3 (FSDP's mixed precision: its fp32 shards are the masters). Each run matches one
process running the same recipe (bf16 parameters, fp32 masters and gradient sums, bf16
autocast) within bf16 noise, with clipping on and accumulation > 1, and holds per rank the
parameter, gradient, master and optimizer bytes the planner states for the layout.

Used by `test_pp_tied_bf16_masters.py` (a few layouts) and `bench/pp_tied_bf16_cpu.py` (all of
`LAYOUTS_2`/`LAYOUTS_4`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from tests.helpers.dist_compare import rel_max
from tests.helpers.dist_worker import run_trainer, train_steps

STEPS = 3
LOW_TOL = 2e-2  # bf16 rounding noise (test_parity.py's tolerance for bf16/fp16 layouts)
BF16 = ["--precision.dtype", "bf16", "--precision.param_dtype", "bf16"]
STATES = ("weights", "gradients", "master_weights", "optimizer")


def _nbytes(t: torch.Tensor) -> int:
    t = t.to_local() if isinstance(t, DTensor) else t
    return t.numel() * t.element_size()


def held_bytes(trainer: Any) -> dict[str, int]:
    """What this rank holds of each model state (just before an optimizer step, for the
    gradients; the optimizer's state exists from the first step on): parameters, fp32
    gradients (the partitioned optimizer's buffers, or FSDP's sharded gradients), fp32
    masters and optimizer state (tensors, not step counters). FSDP's fp32 shards are its
    masters: there the parameters count as master weights and the weights as 0."""
    opt = trainer.optimizer
    params = list(trainer.model.parameters())
    state = sum(_nbytes(v) for s in opt.state.values() for v in s.values()
                if isinstance(v, torch.Tensor) and v.ndim > 0)
    if trainer.par.fsdp:
        return {"weights": 0, "master_weights": sum(_nbytes(p) for p in params),
                "gradients": sum(_nbytes(p.grad) for p in params if p.grad is not None),
                "optimizer": state}
    masters = getattr(opt, "master", {})
    return {"weights": sum(_nbytes(p) for p in params),
            "master_weights": sum(_nbytes(m) for m in masters.values()),
            "gradients": sum(_nbytes(h.grad) for h in opt.sync_params() if h.grad is not None),
            "optimizer": state}


def planned_bytes(trainer: Any, zero: int) -> dict[str, int]:
    """The planner's per-rank model-state bytes for this run's layout and recipe."""
    from scaletrain.plan.estimate import estimate
    from scaletrain.plan.layout import Layout

    cfg = trainer.cfg
    lay = Layout(dims=trainer.par.dims, mbs=cfg.training.micro_batch_size,
                 seq_len=cfg.data.seq_len, gbs=trainer.global_batch, zero=zero,
                 precision="bf16", param_dtype="bf16",
                 kernels="cpu", schedule=cfg.parallel.pp_schedule)
    plan = estimate(trainer.model_args, lay)
    assert not plan.trainer_problems, plan.trainer_problems
    return {**{k: plan.memory_bytes[k] for k in STATES}, "stage": plan.stage}


def run_job(argv: list[str], zero: int) -> dict[str, Any]:
    """One rank's side of a layout: STEPS steps, the bytes held and planned, the dtypes."""
    from scaletrain.train.trainer import Trainer
    from tests.helpers.dist_worker import BASE, MODEL
    from tests.helpers.trainer import tiny_config

    cfg = tiny_config(Path(argv[0]), Path(argv[1]), *MODEL, *BASE, *argv[2:],
                      "--training.steps", str(STEPS))
    trainer = Trainer(cfg)
    norms: list[float] = []
    # `train_steps` asks for the gradients just before the first optimizer step: the moment
    # every state is held; the byte counts travel as tensors
    losses, got = train_steps(trainer, STEPS, lambda: {
        k: torch.tensor(v) for k, v in held_bytes(trainer).items()}, norms)
    held = {k: int(v) for k, v in got.items()}
    held["optimizer"] = held_bytes(trainer)["optimizer"]  # created by the first step
    # the stored dtypes (before evaluation: ZeRO-2 keeps the gathered bf16 ones after forward)
    dtypes = {str(p.dtype) for p in trainer.model.parameters()}
    return {"losses": losses, "norms": norms, "val": trainer.evaluate(), "held": held,
            "planned": planned_bytes(trainer, zero), "dtypes": dtypes,
            "pp_rank": trainer.par.pp_rank}


# name, flags, data-parallel degree, ZeRO stage (for the plan), GA
LAYOUTS_2 = [
    ("bf16-zero1", ["--parallel.data_parallel", "zero1"], 2, 1, 2),
    ("bf16-zero2-fsdp", ["--parallel.data_parallel", "zero2"], 2, 2, 2),
    ("bf16-ddp", ["--parallel.data_parallel", "ddp"], 2, 0, 2),
    ("bf16-zero3-fsdp", ["--parallel.data_parallel", "zero3"], 2, 3, 2),
]
LAYOUTS_4 = [
    ("bf16-zero1-x-tp2", ["--parallel.data_parallel", "zero1", "--parallel.tp", "2"], 2, 1, 2),
    ("bf16-zero1-x-pp2", ["--parallel.data_parallel", "zero1", "--parallel.pp", "2"], 2, 1, 2),
    ("bf16-zero2-fsdp-x-pp2", ["--parallel.data_parallel", "zero2", "--parallel.pp", "2"], 2,
     2, 2),
]


def references(tmp: Path, cache: Path, layouts: list) -> dict[tuple[int, int], dict[str, Any]]:
    """One process running the same recipe on the same global batches."""
    refs = {}
    for dp, ga in sorted({(dp, ga) for _, _, dp, _, ga in layouts}):
        out = run_trainer([str(tmp / f"ref-bf16-{dp}-{ga}"), str(cache), *BF16,
                           "--training.micro_batch_size", str(4 * dp),
                           "--training.grad_accum_steps", str(ga)], STEPS, capture=False)
        out.pop("trainer")
        refs[(dp, ga)] = out
    return refs


def jobs(tmp: Path, cache: Path, layouts: list) -> list[tuple]:
    return [("bf16", name, [str(tmp / name), str(cache), *BF16, *flags,
                            "--training.grad_accum_steps", str(ga)], zero)
            for name, flags, _, zero, ga in layouts]


def check(result: list[dict[str, Any]], layouts: list, refs: dict, world: int) -> list[str]:
    """Parity within bf16 noise, bf16 weights, and the bytes the plan states (asserted);
    table rows back: relative errors, then per rank held / planned bytes."""
    rows = []
    for name, _, dp, _, ga in layouts:
        ref = refs[(dp, ga)]
        dloss = rel_max(result[0][name]["losses"], ref["losses"])
        dnorm = max(rel_max(r[name]["norms"], ref["norms"]) for r in result)
        dval = abs(result[0][name]["val"] - ref["val"]) / ref["val"]
        rows.append(f"| {name} | {world} | {dloss:.1e} | {dnorm:.1e} | {dval:.1e} |")
        assert max(dloss, dnorm, dval) <= LOW_TOL, rows[-1]
        fsdp = "fsdp" in name  # FSDP: fp32 shards, gathered in bf16
        assert result[0][name]["dtypes"] == {"torch.float32" if fsdp else "torch.bfloat16"}, \
            (name, result[0][name]["dtypes"])
        for rank, r in enumerate(result):
            held, planned = r[name]["held"], r[name]["planned"]
            rows.append(f"|   rank {rank} (stage {r[name]['pp_rank']}) | held "
                        + ", ".join(f"{k} {held[k]}" for k in STATES) + " | planned "
                        + ", ".join(f"{k} {planned[k]}" for k in STATES)
                        + f" (stage {planned['stage']}) |")
            if r[name]["pp_rank"] != planned["stage"]:
                continue  # the plan is of the most loaded stage; compare the ranks of that one
            for key in ("weights", "gradients"):
                assert held[key] == planned[key], (name, key, held, planned)
            for key in ("master_weights", "optimizer"):
                # ZeRO-1 owns whole parameters (greedy, largest first): a rank's share is
                # within 5 % of the plan's even split
                assert abs(held[key] - planned[key]) <= 0.05 * planned[key], (name, key)
    return rows
