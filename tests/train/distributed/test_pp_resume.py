"""Pipeline-parallel runs resume from their own checkpoints (issue: every layout resumes).

Each layout trains 2 steps, saves, and a new trainer resumes for 2 more: the 4 losses equal the
uninterrupted 4-step run bitwise (fp32, clipping on, accumulation > 1); the checkpoint of one
layout resumes in another PP schedule, in one process and in FSDP 4 within 1e-5. Before the
optimizer state was keyed by parameter name (`train/optim_state.py`) every layout here crashed
at the first step after the resume (`KeyError: 'betas'`): DCP kept one stage's positional
group lists, so the other stage's parameters were in no group."""

from __future__ import annotations

from pathlib import Path

import pytest

from scaletrain.checkpoint.safe_dcp import read_metadata
from tests.helpers.dist_worker import run_trainer, spawn

TIED = ["--model.tie_embeddings", "true"]
PP2 = ["--parallel.pp", "2"]
GA2 = ["--training.grad_accum_steps", "2"]
GA4 = ["--training.grad_accum_steps", "4"]
LAYOUTS_2 = [
    ("1f1b-tied", [*PP2, "--parallel.pp_schedule", "1F1B", *GA2, *TIED]),
    ("gpipe", [*PP2, "--parallel.pp_schedule", "GPipe", *GA2]),
    ("interleaved-v2-tied", [*PP2, "--parallel.pp_schedule", "Interleaved1F1B",
                             "--parallel.pp_virtual_stages", "2", *GA4, *TIED]),
    ("zbv", [*PP2, "--parallel.pp_schedule", "ZBVZeroBubble", "--parallel.pp_virtual_stages",
             "2", *GA4]),
]
LAYOUTS_4 = [
    ("x-ddp2-tied", [*PP2, "--parallel.data_parallel", "ddp", *GA2, *TIED]),
    ("x-zero1-tied", [*PP2, "--parallel.data_parallel", "zero1", *GA2, *TIED]),
    ("x-fsdp2-tied", [*PP2, "--parallel.data_parallel", "zero3", *GA2, *TIED]),
]


# A checkpoint of the first layout resumed in another (name, flags, world size): equal to the
# uninterrupted run of the first within the parity tests' tolerance (another reduction order).
ACROSS_2 = ("1f1b-tied", [
    ("interleaved-v2", [*PP2, "--parallel.pp_schedule", "Interleaved1F1B",
                        "--parallel.pp_virtual_stages", "2", *GA2, *TIED], 2),
    ("one-process", [*GA2, *TIED], 1),
])
ACROSS_4 = ("x-zero1-tied", [
    ("fsdp4", ["--parallel.data_parallel", "zero3", "--training.grad_accum_steps", "1",
               *TIED], 4),
])
REL_TOL = 1e-5


def _resume_equals_uninterrupted(tmp_path: Path, world: int,
                                 layouts: list[tuple[str, list[str]]],
                                 across: tuple[str, list[tuple[str, list[str], int]]]) -> None:
    cache = str(tmp_path / "cache")

    def argv(name: str, run: str, flags: list[str], *extra: str) -> list[str]:
        return [str(tmp_path / f"{run}-{name}"), cache, *flags, "--training.steps", "4", *extra]

    for d in ("a", "b"):
        (tmp_path / d).mkdir()
    full = spawn(world, [(f"full-{n}", argv(n, "full", f), {"capture": False})
                         for n, f in layouts], 4, tmp_path / "a")[0]
    jobs = []
    for n, f in layouts:
        jobs += [(f"save-{n}", argv(n, "split", f), {"save": True, "capture": False}),
                 (f"resume-{n}", argv(n, "split", f, "--checkpoint.resume", "true"),
                  {"capture": False})]
    split = spawn(world, jobs, 2, tmp_path / "b")[0]
    for n, _ in layouts:
        losses = split[f"save-{n}"]["losses"] + split[f"resume-{n}"]["losses"]
        assert losses == full[f"full-{n}"]["losses"], (n, losses, full[f"full-{n}"]["losses"])
        keys = set(read_metadata(split[f"save-{n}"]["checkpoint"]).state_dict_metadata)
        # both stages' parameters carry their group settings, under their own names
        assert {"optimizer.param_groups.layers.0.attention.wq.weight.lr",
                "optimizer.param_groups.layers.3.attention.wq.weight.lr",
                "optimizer.param_groups.norm.weight.lr"} <= keys, n
    source, targets = across
    ref = full[f"full-{source}"]["losses"][2:]
    for name, flags, ranks in targets:
        job = argv(source, "split", flags, "--checkpoint.resume", "true")
        if ranks == 1:
            res = run_trainer(job, 2, capture=False)["losses"]
        else:
            out = tmp_path / f"across-{name}"
            out.mkdir()
            res = spawn(ranks, [(name, job, {"capture": False})], 2, out)[0][name]["losses"]
        assert all(abs(a - b) <= REL_TOL * abs(b) for a, b in zip(res, ref, strict=True)), \
            (name, res, ref)


@pytest.mark.distributed
def test_pipeline_runs_resume_exactly(tmp_path: Path) -> None:
    _resume_equals_uninterrupted(tmp_path, 2, LAYOUTS_2, ACROSS_2)


@pytest.mark.distributed
@pytest.mark.slow
def test_pipeline_x_data_parallel_runs_resume_exactly(tmp_path: Path) -> None:
    _resume_equals_uninterrupted(tmp_path, 4, LAYOUTS_4, ACROSS_4)
