"""Every combination the feasibility function accepts trains like one process: the generated
parity matrix (`parity_matrix.py`).

`make test` runs a pairwise covering subset of the accepted combinations (every pair of option
values that can occur together occurs in some run) plus the named cases below;
`SCALETRAIN_PARITY_SAMPLE=N` adds N accepted combinations drawn at random (seed 0);
`SCALETRAIN_PARITY_FULL=1` runs every accepted combination (about 12 hours on 2 cores: a
nightly job on a bigger machine).
Each run trains 3 steps with clipping on, saving a checkpoint after step 2, and is compared with
one process on the same sequences (micro-batch x dp, the same accumulation, model and
precision); then a new trainer resumes every run from its checkpoint in the same layout (its
step 3 and validation loss must equal the run's bitwise) and every 4th multi-process fp32 run's
checkpoint in one process (within 1e-5):
- fp32: every step's loss and gradient norm and the validation loss within 1e-5 relative, the
  first step's gradients within 2e-6 of the largest entry of each tensor;
- bf16/fp16: within the 16-bit noise of one process, which is statistical. The first step's
  loss and gradient norm (before any update) within max(4 x D1, 2^-11), later steps and the
  validation loss within max(4 x D, 2^-8), where D1 and D are the distances of the one-process
  run in that dtype from the one-process fp32 run (first step; every value); and not equal to
  fp32 (autocast ran). A factor of 1 fails correct layouts: one sample of D can be small by
  chance (1e-4) while a layout's other rounding (ring attention, tensor-parallel partial sums,
  a near-tied MoE route flipping, AdamW turning a rounding sign into a full update) moves the
  third step's norm by 1-2e-3. The bugs this matrix exists for move the first step by percents.
`SCALETRAIN_PARITY_TABLE=FILE` appends the rows and the worst error per option to FILE.
"""

from __future__ import annotations

import os
import random
import time
from pathlib import Path
from typing import Any

import pytest

from tests.helpers.dist_compare import grad_error, rel_max
from tests.helpers.dist_worker import run_job, run_trainer, spawn
from tests.helpers.parity_matrix import (
    FACTORS,
    NAMES,
    Combo,
    accepted,
    covered_pairs,
    pairwise_cover,
    problems,
)

STEPS = 3
LOSS_TOL = 1e-5  # losses, gradient norms, validation loss (fp32, relative)
GRAD_TOL = 2e-6  # max |g - g_ref| / max |g_ref| per tensor (first step)
FIRST_STEP_FLOOR = 2.0**-11  # fp16's unit roundoff
LATER_FLOOR = 2.0**-7  # two of bf16's
NOISE_FACTOR = 4.0
RESUME_AT = 2  # every run saves after this step; a new trainer resumes from it
RESUME_ELSEWHERE = 4  # every 4th multi-process fp32 run's checkpoint also resumes in one process
FULL = os.environ.get("SCALETRAIN_PARITY_FULL") == "1"
SAMPLE = int(os.environ.get("SCALETRAIN_PARITY_SAMPLE", "0"))
TABLE = os.environ.get("SCALETRAIN_PARITY_TABLE")


def _combo(**values: Any) -> Combo:
    base = {"dp": "none", "tp": "1", "pp": "none", "cp": 1, "experts": "dense",
            "precision": "fp32", "recompute": "none", "fused_loss": False, "ga": 2}
    return Combo(tuple({**base, **values}[k] for k in NAMES))


# Named cases: the combinations that once trained on wrong gradients, silently.
NAMED = [
    _combo(dp="zero3", pp="ZBVZeroBubble", ga=4),
    _combo(dp="zero3", pp="InterleavedZeroBubble", ga=4),
]


def matrix() -> list[Combo]:
    """The runs: the pairwise cover, or every accepted combination (`FULL`), or the cover plus
    a seeded random sample of `SAMPLE` more accepted combinations; then the named cases."""
    if FULL:
        runs = list(accepted())
    else:
        runs = pairwise_cover(accepted())
        rest = [c for c in accepted() if c not in runs]
        runs += random.Random(0).sample(rest, min(SAMPLE, len(rest)))
    return runs + [c for c in NAMED if c not in runs]


def test_matrix_covers_every_pair_the_feasibility_function_accepts() -> None:
    runs = pairwise_cover(accepted())
    assert covered_pairs(runs) == covered_pairs(accepted())
    assert all(not problems(c) for c in [*runs, *NAMED])
    # every option value occurs (none is refused in every combination)
    for name, values in FACTORS.items():
        assert {c[name] for c in runs} == set(values), name
    # the same matrix on every run, much smaller than what it covers
    assert pairwise_cover(accepted()) == runs
    assert len(runs) < len(accepted()) / 100


def _fp32_errors(got: dict[str, Any], ref: dict[str, Any]) -> dict[str, float]:
    return {"loss": rel_max(got["losses"], ref["losses"]),
            "norm": max(rel_max(norms, ref["norms"]) for norms in got["rank_norms"]),
            "val": abs(got["val"] - ref["val"]) / ref["val"],
            "grad": grad_error(got["rank_grads"], ref["grads"])}


def _low_error(got: dict[str, Any], ref: dict[str, Any], fp32: dict[str, Any]
               ) -> tuple[float, float, float]:
    """The run's distance from one process in its dtype as a fraction of the 16-bit noise
    allowed (the larger of the first-step and every-value terms; see the module docstring),
    its distance over every value, and the distance allowed there."""
    def first(a: dict[str, Any], b: dict[str, Any]) -> float:
        return max(rel_max(a["losses"][:1], b["losses"][:1]),
                   rel_max(a["norms"][:1], b["norms"][:1]))

    def every(a: dict[str, Any], b: dict[str, Any]) -> float:
        return max(rel_max(a["losses"], b["losses"]), rel_max(a["norms"], b["norms"]),
                   abs(a["val"] - b["val"]) / b["val"])

    assert got["losses"] != fp32["losses"], "16-bit losses equal fp32 ones: autocast not run"
    allowed_first = max(NOISE_FACTOR * first(ref, fp32), FIRST_STEP_FLOOR)
    allowed = max(NOISE_FACTOR * every(ref, fp32), LATER_FLOOR)
    score = max(first(got, ref) / allowed_first, every(got, ref) / allowed)
    return score, every(got, ref), allowed


def _merge_ranks(result: list[dict[str, Any]], name: str) -> dict[str, Any]:
    """Rank 0's losses and validation (every rank reports the same), every rank's gradients
    and norms (each checked)."""
    out = dict(result[0][name])
    out["rank_grads"] = [rank[name]["grads"] for rank in result]
    out["rank_norms"] = [rank[name]["norms"] for rank in result]
    return out


def _run_matrix(tmp: Path, runs: list[Combo]) -> tuple[dict[str, dict], dict[tuple, dict]]:
    cache = tmp / "cache"
    keys = {c.reference_key(d) for c in runs for d in {str(c["precision"]), "fp32"}}
    refs = {}
    for n, key in enumerate(sorted(keys, key=str)):
        mbs, ga, model, dtype = key
        out = run_trainer([str(tmp / f"ref{n}"), str(cache), *model,
                           "--training.micro_batch_size", str(mbs),
                           "--training.grad_accum_steps", str(ga), "--precision.dtype", dtype],
                          STEPS, capture=dtype == "fp32")
        out.pop("trainer")
        refs[key] = out
    results: dict[str, dict] = {}
    by_world: dict[int, list[tuple[int, Combo]]] = {}
    for i, c in enumerate(runs):
        by_world.setdefault(c.dims.world_size, []).append((i, c))
    for world, group in sorted(by_world.items()):
        jobs = []
        for i, c in group:
            argv = [str(tmp / f"run{i}"), str(cache), *c.argv()]
            jobs += [(f"run{i}", argv, {"capture": c["precision"] == "fp32",
                                        "save_at": RESUME_AT}),
                     (f"resume{i}", [*argv, "--training.steps", str(STEPS),
                                     "--checkpoint.resume", "true"],
                      {"capture": False, "steps": STEPS - RESUME_AT})]
        if world == 1:
            ranks = [{name: run_job(argv, opts, STEPS) for name, argv, opts in jobs}]
        else:
            out_dir = tmp / f"world{world}"
            out_dir.mkdir()
            ranks = spawn(world, jobs, STEPS, out_dir)
        for i, _ in group:
            results[f"run{i}"] = _merge_ranks(ranks, f"run{i}")
            results[f"resume{i}"] = ranks[0][f"resume{i}"]
    for i in elsewhere(runs):  # the same checkpoints resumed in one process
        mbs, ga, model, dtype = runs[i].reference_key()
        results[f"one{i}"] = run_job(
            [str(tmp / f"run{i}"), str(cache), *model, "--training.micro_batch_size", str(mbs),
             "--training.grad_accum_steps", str(ga), "--precision.dtype", dtype,
             "--training.steps", str(STEPS), "--checkpoint.resume", "true"],
            {"capture": False, "steps": STEPS - RESUME_AT}, STEPS)
    return results, refs


def elsewhere(runs: list[Combo]) -> list[int]:
    """The runs whose checkpoint is also resumed in one process: every RESUME_ELSEWHERE-th
    multi-process fp32 run."""
    picked = [i for i, c in enumerate(runs) if c.dims.world_size > 1
              and c["precision"] == "fp32"]
    return picked[::RESUME_ELSEWHERE]


def _check_resumes(runs: list[Combo], results: dict[str, dict]) -> list[str]:
    """Every run saved after RESUME_AT steps and a new trainer resumed from that checkpoint in
    the same layout: its remaining losses and validation loss equal the run's, bitwise (fp32
    and 16-bit: the same layout computes the same); in one process (`elsewhere`) within the
    fp32 tolerance."""
    bad, rows = [], []
    for i, c in enumerate(runs):
        run, resumed = results[f"run{i}"], results[f"resume{i}"]
        same = resumed["losses"] == run["losses"][RESUME_AT:] and resumed["val"] == run["val"]
        cells = "bitwise" if same else f"{resumed['losses']} vs {run['losses'][RESUME_AT:]}"
        if f"one{i}" in results:
            one = results[f"one{i}"]
            err = max(rel_max(one["losses"], run["losses"][RESUME_AT:]),
                      abs(one["val"] - run["val"]) / run["val"])
            cells += f"; in one process {err:.1e}"
            same = same and err <= LOSS_TOL
        rows.append(f"| resume | {c.name} | {cells} |")
        if not same:
            bad.append(rows[-1])
    print("\n".join(rows))
    assert not bad, "\n".join(bad)
    return rows


def _check(runs: list[Combo], results: dict[str, dict], refs: dict[tuple, dict]) -> list[str]:
    """Rows of the table; asserts every run within its tolerance."""
    bad, rows = [], []
    worst: dict[tuple[str, object], float] = {}
    for i, c in enumerate(runs):
        got, ref = results[f"run{i}"], refs[c.reference_key()]
        if c["precision"] == "fp32":
            e = _fp32_errors(got, ref)
            score = max(e["loss"] / LOSS_TOL, e["norm"] / LOSS_TOL, e["val"] / LOSS_TOL,
                        e["grad"] / GRAD_TOL)
            cells = f"loss {e['loss']:.1e} norm {e['norm']:.1e} grad {e['grad']:.1e} " \
                    f"val {e['val']:.1e}"
        else:
            score, err, allowed = _low_error(got, ref, refs[c.reference_key("fp32")])
            cells = f"{c['precision']} {err:.1e} (allowed {allowed:.1e})"
        rows.append(f"| {c.dims.world_size} | {c.name} | {cells} | {score:.2f} |")
        for name in NAMES:
            worst[(name, c[name])] = max(worst.get((name, c[name]), 0.0), score)
        if score > 1.0:
            bad.append(rows[-1])
    rows.append("")
    rows.append("worst error per option (fraction of its tolerance):")
    rows += [f"  {name}={value}: {score:.2f}" for (name, value), score in sorted(
        worst.items(), key=lambda kv: (NAMES.index(kv[0][0]), str(kv[0][1])))]
    print("\n".join(rows))
    assert not bad, "\n".join(bad)
    return rows


@pytest.mark.distributed
def test_every_accepted_combination_matches_one_process(tmp_path: Path) -> None:
    runs = matrix()
    start = time.monotonic()
    results, refs = _run_matrix(tmp_path, runs)
    rows = _check(runs, results, refs) + _check_resumes(runs, results)
    if TABLE:
        worlds = sorted({c.dims.world_size for c in runs})
        with open(TABLE, "a") as f:
            kind = "full product" if FULL else f"pairwise + {SAMPLE} sampled" if SAMPLE \
                else "pairwise"
            f.write(f"{len(runs)} runs ({kind}; worlds "
                    f"{worlds}) covering {len(covered_pairs(runs))} option pairs of "
                    f"{len(accepted())} accepted combinations, {len(refs)} references, "
                    f"{time.monotonic() - start:.0f} s\n")
            f.write("\n".join(rows) + "\n")
