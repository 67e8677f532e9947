"""A tied embedding/head under pipeline parallelism (Megatron's embedding group), checked
against one process: the first and last stage both hold the weight, their gradients are summed
after backward, and the run matches one process (fp32, clipping on, accumulation > 1); the two
copies stay equal; a checkpoint saved by the pipeline (one logical tied tensor) resumes in one
process as the uninterrupted one-process run continues.

Used by `test_pp_tied_bf16_masters.py` (a few layouts) and `bench/pp_tied_bf16_cpu.py` (all of
`LAYOUTS_2`/`LAYOUTS_4`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from tests.helpers.dist_compare import grad_error, rel_max
from tests.helpers.dist_worker import run_trainer

STEPS = 3
RESUMED = 2
TOTAL = ["--training.steps", str(STEPS + RESUMED)]  # every run's LR schedule
LOSS_TOL = 1e-5  # relative, fp32 (test_parity.py's tolerance for layouts with another order)
GRAD_TOL = 2e-6
TIED = ["--model.tie_embeddings", "true"]

# name, flags, micro-batch size of the one-process reference, GA
LAYOUTS_2 = [
    ("tied-pp2-1f1b", ["--parallel.pp", "2", "--parallel.pp_schedule", "1F1B"], 4, 2),
    ("tied-pp2-gpipe", ["--parallel.pp", "2", "--parallel.pp_schedule", "GPipe"], 4, 2),
    ("tied-pp2-interleaved", ["--parallel.pp", "2", "--parallel.pp_schedule",
                              "Interleaved1F1B", "--parallel.pp_virtual_stages", "2"], 4, 4),
]
LAYOUTS_4 = [
    ("tied-pp2-x-tp2", ["--parallel.pp", "2", "--parallel.tp", "2", "--parallel.dp_shard",
                        "1"], 4, 2),
    ("tied-pp4-1f1b", ["--parallel.pp", "4", "--parallel.pp_schedule", "1F1B"], 4, 4),
    ("tied-pp2-x-fsdp2", ["--parallel.pp", "2", "--parallel.pp_schedule", "1F1B"], 8, 2),
    ("tied-pp2-x-zero1", ["--parallel.pp", "2", "--parallel.data_parallel", "zero1"], 8, 2),
]


def tied_weight(trainer: Any) -> torch.Tensor | None:
    """The full tied weight this rank holds (None off the embedding group); a DTensor's
    `full_tensor` is a collective of its mesh, whose ranks all sit at this pipeline rank."""
    params = trainer.par.tied_parameters()
    if not params:
        return None
    w = params[0]
    return (w.full_tensor() if isinstance(w, DTensor) else w).detach().float().clone()


def run_job(argv: list[str], save: bool) -> dict[str, Any]:
    """One rank's side of a layout: STEPS steps (gradients of the first captured), the tied
    copy it holds afterwards, and a checkpoint when `save`."""
    res = run_trainer(argv, STEPS, save=save)
    trainer = res.pop("trainer")
    res["tied"] = tied_weight(trainer)
    res["tied_copy"] = trainer.par.tied_copy
    # what the stages keep between steps: no micro-batch output (the last stage's logits)
    res["kept_outputs"] = sum(len(s.output_chunks) for s in trainer.par.stages)
    return res


def references(tmp: Path, cache: Path, layouts: list) -> dict[tuple[int, int], dict[str, Any]]:
    """One process, the same global batches, STEPS + RESUMED steps straight."""
    refs = {}
    for mbs, ga in sorted({(mbs, ga) for _, _, mbs, ga in layouts}):
        out = run_trainer([str(tmp / f"ref-{mbs}-{ga}"), str(cache), *TIED, *TOTAL,
                           "--training.micro_batch_size", str(mbs),
                           "--training.grad_accum_steps", str(ga)], STEPS + RESUMED)
        out.pop("trainer")
        refs[(mbs, ga)] = out
    return refs


def jobs(tmp: Path, cache: Path, layouts: list) -> list[tuple]:
    """("tied", name, argv, save): the first layout saves its checkpoint."""
    return [("tied", name, [str(tmp / name), str(cache), *TIED, *TOTAL, *flags,
                            "--training.grad_accum_steps", str(ga)], i == 0)
            for i, (name, flags, _, ga) in enumerate(layouts)]


def check(result: list[dict[str, Any]], tmp: Path, cache: Path, layouts: list,
          refs: dict, world: int) -> list[str]:
    """Compare every layout with its reference (asserting the tolerances); table rows back."""
    rows, bad = [], []
    for name, _, mbs, ga in layouts:
        ref = refs[(mbs, ga)]
        dloss = rel_max(result[0][name]["losses"], ref["losses"][:STEPS])
        dnorm = max(rel_max(r[name]["norms"], ref["norms"][:STEPS]) for r in result)
        dgrad = grad_error((r[name]["grads"] for r in result), ref["grads"], name)
        copies = [r[name]["tied"] for r in result if r[name]["tied"] is not None]
        assert any(r[name]["tied_copy"] for r in result), name  # the layout split the two
        assert len(copies) >= 2 and all(torch.equal(c, copies[0]) for c in copies), name
        assert not any(r[name]["kept_outputs"] for r in result), name  # return_outputs=False
        rows.append(f"| {name} | {world} | {dloss:.1e} | {dnorm:.1e} | {dgrad:.1e} | "
                    f"copies equal ({len(copies)} ranks) |")
        if dloss > LOSS_TOL or dnorm > LOSS_TOL or dgrad > GRAD_TOL:
            bad.append(rows[-1])
    name, _, mbs, ga = layouts[0]  # its checkpoint, continued in one process
    more = run_trainer([str(tmp / name), str(cache), *TIED, *TOTAL, "--checkpoint.resume",
                        "true", "--training.micro_batch_size", str(mbs),
                        "--training.grad_accum_steps", str(ga)], RESUMED, capture=False)
    assert more["trainer"].step == STEPS + RESUMED
    dres = rel_max(more["losses"], refs[(mbs, ga)]["losses"][STEPS:])
    rows.append(f"| {name}: checkpoint resumed in one process | 1 | {dres:.1e} | - | - | - |")
    if dres > LOSS_TOL:
        bad.append(rows[-1])
    assert not bad, bad
    return rows
