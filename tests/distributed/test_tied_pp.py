"""A tied embedding/head under pipeline parallelism (Megatron's embedding group): the first and
last stage both hold the weight, their gradients are summed after backward, and the run
matches one process (fp32, clipping on, accumulation > 1); the two copies stay equal, and a
checkpoint saved by the pipeline resumes in one process as the uninterrupted run continues."""

from __future__ import annotations

import traceback
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from tests.distributed.compare import grad_error, rel_max
from tests.distributed.worker import run_trainer
from tests.proc_helpers import run_ranks

STEPS = 3
TOTAL = ["--training.steps", str(STEPS + 2)]  # the LR schedule of every run: 2 more resumed
LOSS_TOL = 1e-5  # relative, fp32 (test_parity.py's tolerance for layouts with another order)
GRAD_TOL = 2e-6
TIED = ["--model.tie_embeddings", "true"]


def _tied_weight(trainer: Any) -> torch.Tensor | None:
    """The full tied weight this rank holds (None off the embedding group); a DTensor's
    `full_tensor` is a collective of its mesh, whose ranks all sit at this pipeline rank."""
    params = trainer.par.tied_parameters()
    if not params:
        return None
    w = params[0]
    return (w.full_tensor() if isinstance(w, DTensor) else w).detach().float().clone()


def _entry(rank: int, world: int, jobs: list[tuple], out_dir: str) -> None:
    results: dict[str, Any] = {}
    try:
        for name, argv, save in jobs:
            res = run_trainer(argv, STEPS, save=save)
            trainer = res.pop("trainer")
            res["tied"] = _tied_weight(trainer)
            res["pp_rank"], res["tied_copy"] = trainer.par.pp_rank, trainer.par.tied_copy
            results[name] = res
            dist.barrier()
    except Exception:
        results["error"] = traceback.format_exc()
        raise
    finally:
        torch.save(results, Path(out_dir) / f"rank{rank}.pt")


def _spawn(world: int, jobs: list[tuple], tmp: Path) -> list[dict[str, Any]]:
    run_ranks(_entry, world, jobs, str(tmp))
    return [torch.load(tmp / f"rank{r}.pt", weights_only=False) for r in range(world)]


def _check(result: list[dict[str, Any]], name: str, ref: dict[str, Any]) -> tuple[float, ...]:
    """(loss, grad-norm, gradient) relative errors; the copies of the tied weight equal."""
    dloss = rel_max(result[0][name]["losses"], ref["losses"])
    dnorm = max(rel_max(r[name]["norms"], ref["norms"]) for r in result)
    dgrad = grad_error((r[name]["grads"] for r in result), ref["grads"], name)
    copies = [r[name]["tied"] for r in result if r[name]["tied"] is not None]
    assert any(r[name]["tied_copy"] for r in result), name  # the layout really split them
    assert len(copies) >= 2 and all(torch.equal(c, copies[0]) for c in copies), name
    return dloss, dnorm, dgrad


def _reference(tmp: Path, cache: Path, name: str, *flags: str) -> dict[str, Any]:
    out = run_trainer([str(tmp / name), str(cache), *TIED, *TOTAL, *flags], STEPS, save=True)
    out.pop("trainer")
    return out


LAYOUTS_2 = [  # name, flags, micro-batch size of the one-process reference, GA
    ("pp2-gpipe", ["--parallel.pp", "2", "--parallel.pp_schedule", "GPipe"], 4, 2),
    ("pp2-interleaved", ["--parallel.pp", "2", "--parallel.pp_schedule", "Interleaved1F1B",
                         "--parallel.pp_virtual_stages", "2"], 4, 4),
]
LAYOUTS_4 = [
    ("pp4-1f1b", ["--parallel.pp", "4", "--parallel.pp_schedule", "1F1B"], 4, 4),
    ("pp2-x-fsdp2", ["--parallel.pp", "2", "--parallel.pp_schedule", "1F1B"], 8, 2),
    ("pp2-x-zero1", ["--parallel.pp", "2", "--parallel.data_parallel", "zero1"], 8, 2),
    ("pp2-x-tp2", ["--parallel.pp", "2", "--parallel.tp", "2", "--parallel.dp_shard", "1"],
     4, 2),
]


def _run(tmp: Path, world: int, layouts: list) -> dict[str, tuple[float, ...]]:
    cache = tmp / "cache"
    refs = {(mbs, ga): _reference(tmp, cache, f"ref-{mbs}-{ga}", "--training.micro_batch_size",
                                  str(mbs), "--training.grad_accum_steps", str(ga))
            for mbs, ga in sorted({(mbs, ga) for _, _, mbs, ga in layouts})}
    jobs = [(name, [str(tmp / name), str(cache), *TIED, *TOTAL, *flags,
                    "--training.grad_accum_steps",
                    str(ga)], name == layouts[0][0])
            for name, flags, _, ga in layouts]
    result = _spawn(world, jobs, tmp)
    table = {}
    for name, _, mbs, ga in layouts:
        table[name] = _check(result, name, refs[(mbs, ga)])
        print(f"| {name} | {world} | loss {table[name][0]:.1e} | norm {table[name][1]:.1e} | "
              f"grad {table[name][2]:.1e} |")
    # The pipeline's checkpoint (one logical tied tensor) continues in one process as the
    # uninterrupted one-process run does.
    name, _, mbs, ga = layouts[0]
    ref = refs[(mbs, ga)]
    resume = [*TIED, *TOTAL, "--checkpoint.resume", "true", "--training.micro_batch_size",
              str(mbs), "--training.grad_accum_steps", str(ga)]
    more = run_trainer([str(tmp / name), str(cache), *resume], 2, capture=False)
    cont = run_trainer([str(tmp / f"ref-{mbs}-{ga}"), str(cache), *resume], 2, capture=False)
    assert more["trainer"].step == cont["trainer"].step == STEPS + 2
    assert rel_max(cont["losses"], ref["losses"][:2]) > 0  # a continuation, not a restart
    table["resume"] = (rel_max(more["losses"], cont["losses"]), 0.0, 0.0)
    print(f"| {name} resumed in one process | 1 | loss {table['resume'][0]:.1e} |")
    return table


def _assert(table: dict[str, tuple[float, ...]]) -> None:
    bad = {k: v for k, v in table.items() if v[0] > LOSS_TOL or v[1] > LOSS_TOL
           or v[2] > GRAD_TOL}
    assert not bad, bad


@pytest.mark.distributed
def test_tied_head_two_pipeline_ranks_match_one_process(tmp_path: Path) -> None:
    _assert(_run(tmp_path, 2, LAYOUTS_2))


@pytest.mark.distributed
def test_tied_head_four_ranks_match_one_process(tmp_path: Path) -> None:
    _assert(_run(tmp_path, 4, LAYOUTS_4))
