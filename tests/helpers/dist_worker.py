"""Spawned-process side of the distributed tests: run trainer steps for several layouts in one
process group and save what the parent compares (losses, full gradients, bytes per rank)."""

from __future__ import annotations

import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from tests.helpers.proc import run_ranks
from tests.helpers.trainer import tiny_config

# A model every layout can split: 4 heads / 2 KV heads (tp 2), 4 layers (pp 4 or pp 2 x v 2),
# no tied head (tensor and pipeline parallelism keep embedding and head apart).
MODEL = ["--model.n_layers", "4", "--model.tie_embeddings", "false"]
# The defaults users run: gradient clipping at 1.0 (the tiny model's norms are 1.2-1.9, so it
# engages), fused AdamW at the default learning rate.
BASE = ["--checkpoint.save_final", "false"]


def full_grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every gradient of this rank's model as a full tensor, keyed by its plain name."""
    from scaletrain.parallel.parallelize import clean_name

    out = {}
    for name, p in model.named_parameters():
        if p.grad is None:
            continue
        g = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
        out[clean_name(name)] = g.detach().float().cpu().clone()
    return out


def local_bytes(model: torch.nn.Module, optimizer: Any) -> dict[str, int]:
    """Bytes of parameters and optimizer state this rank holds (shards, not full tensors)."""
    def nbytes(t: torch.Tensor) -> int:
        t = t.to_local() if isinstance(t, DTensor) else t
        return t.numel() * t.element_size()

    from torch.distributed.fsdp import FSDPModule

    for m in model.modules():  # count what a rank holds between steps
        if isinstance(m, FSDPModule):
            m.reshard()
    params = sum(nbytes(p) for p in model.parameters())
    state = sum(nbytes(v) for s in optimizer.state.values() for v in s.values()
                if isinstance(v, torch.Tensor) and v.ndim > 0)
    return {"params": params, "optim": state}


def fp8_gathered(model: torch.nn.Module) -> int:
    """How many parameters FSDP all-gathers in fp8 (torchao's fp8 weight wrapper inside)."""
    def local(p: torch.Tensor) -> torch.Tensor:
        return p.to_local() if isinstance(p, DTensor) else p

    return sum(type(local(p)).__name__ == "WeightWithDynamicFloat8CastTensor"
               for p in model.parameters())


def train_steps(trainer: Any, steps: int, grads_of: Callable[[], dict[str, torch.Tensor]] | None,
                norms: list[float] | None = None) -> tuple[list[float], dict[str, torch.Tensor]]:
    """`steps` training steps; their losses and, with `grads_of`, what it returns just before
    the first optimizer step (the first step's reduced gradients, before the update). Each
    step's gradient norm is appended to `norms` when given."""
    grads: dict[str, torch.Tensor] = {}
    step = trainer.optimizer.step

    def capturing_step(*a: Any, **k: Any) -> Any:
        if grads_of is not None and not grads:
            grads.update(grads_of())
        return step(*a, **k)

    trainer.optimizer.step = capturing_step
    losses = []
    try:
        for _ in range(steps):
            loss, norm = trainer.train_step(trainer.next_batches())
            trainer.step += 1
            losses.append(loss)
            if norms is not None:
                norms.append(norm)
    finally:
        trainer.optimizer.step = step
    return losses, grads


def run_trainer(argv: list[str], steps: int, capture: bool = True,
                save: bool = False, save_at: int | None = None) -> dict[str, Any]:
    """Train `steps` steps; gradients of the first step are captured before the update. With
    `save_at` a checkpoint is saved after that many steps, and the run goes on (a resume from
    it must continue as this run does)."""
    from scaletrain.train.trainer import Trainer

    total = [] if "--training.steps" in argv else ["--training.steps", str(steps)]
    cfg = tiny_config(Path(argv[0]), Path(argv[1]), *MODEL, *BASE, *argv[2:], *total)
    trainer = Trainer(cfg)
    norms: list[float] = []
    first = steps if save_at is None else save_at
    losses, grads = train_steps(trainer, first,
                                (lambda: full_grads(trainer.model)) if capture else None, norms)
    if save_at is not None:
        trainer.save_checkpoint()
        losses += train_steps(trainer, steps - save_at, None, norms)[0]
    moe = None
    if trainer.has_moe:  # the router statistics of the steps (a collective: every rank)
        from scaletrain.train.moe_metrics import collect_moe_stats

        moe = collect_moe_stats(trainer.model, trainer.par)
    val = trainer.evaluate()
    out = {"losses": losses, "norms": norms, "grads": grads, "val": val,
           "bytes": local_bytes(trainer.model, trainer.optimizer),
           "fp8_gathered": fp8_gathered(trainer.model), "moe": moe}
    if save:
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_model_state_dict,
        )

        out["checkpoint"] = str(trainer.save_checkpoint())
        if not trainer.par.enabled or trainer.par.dims.pp == 1:
            full = get_model_state_dict(trainer.model,
                                        options=StateDictOptions(full_state_dict=True))
            out["params"] = {k: v.detach().cpu().clone() for k, v in full.items()}
    out["trainer"] = trainer
    return out


def run_job(argv: list[str], opts: dict[str, Any], steps: int) -> dict[str, Any]:
    """One job of `spawn` (or of one process): `run_trainer` with the job's options, where
    `steps` in them overrides the default; the trainer itself is dropped."""
    options = dict(opts)
    res = run_trainer(argv, options.pop("steps", steps), **options)
    res.pop("trainer")
    return res


def _entry(rank: int, world: int, jobs: list[tuple], steps: int, out_dir: str) -> None:
    results = {}
    try:
        for name, argv, *opts in jobs:
            results[name] = run_job(argv, opts[0] if opts else {}, steps)
            dist.barrier()
    except Exception:
        results["error"] = traceback.format_exc()
        torch.save(results, Path(out_dir) / f"rank{rank}.pt")
        raise
    torch.save(results, Path(out_dir) / f"rank{rank}.pt")


def spawn(world: int, jobs: list[tuple], steps: int, out_dir: Path,
          timeout_s: float = 900.0) -> list[dict[str, Any]]:
    """Run `jobs` (name, argv) in `world` processes; return each rank's results."""
    run_ranks(_entry, world, jobs, steps, str(out_dir), timeout_s=timeout_s)
    return [torch.load(out_dir / f"rank{r}.pt", weights_only=False) for r in range(world)]
