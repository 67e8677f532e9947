"""Two features of the trainer, each against one process, in one launch per world size (a
launch costs seconds): a tied embedding/head under pipeline parallelism (`tied_pp.py`: fp32
parity, equal copies, the checkpoint resumed in one process) and 16-bit parameters with fp32
master weights sharded over the data-parallel ranks (`bf16_masters.py`: parity within bf16
noise, the bytes per rank the planner states). `bench/pp_tied_bf16_cpu.py` runs every layout
of both modules."""

from __future__ import annotations

import traceback
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from tests.helpers import bf16_masters, tied_pp
from tests.helpers.proc import run_ranks


def entry(rank: int, world: int, jobs: list[tuple], out_dir: str) -> None:
    """Every job of a launch: ("tied", name, argv, save) or ("bf16", name, argv, zero)."""
    results: dict[str, Any] = {}
    try:
        for kind, name, argv, opt in jobs:
            run = tied_pp.run_job if kind == "tied" else bf16_masters.run_job
            results[name] = run(argv, opt)
            dist.barrier()
    except Exception:
        results["error"] = traceback.format_exc()
        raise
    finally:
        torch.save(results, Path(out_dir) / f"rank{rank}.pt")


def run_both(tmp: Path, world: int, tied: list, bf16: list) -> list[str]:
    """References, one launch for both kinds of jobs, the checks; the table rows."""
    cache = tmp / "cache"
    tied_refs = tied_pp.references(tmp, cache, tied)
    bf16_refs = bf16_masters.references(tmp, cache, bf16)
    run_ranks(entry, world, [*tied_pp.jobs(tmp, cache, tied),
                             *bf16_masters.jobs(tmp, cache, bf16)], str(tmp))
    result = [torch.load(tmp / f"rank{r}.pt", weights_only=False) for r in range(world)]
    rows = tied_pp.check(result, tmp, cache, tied, tied_refs, world)
    rows += bf16_masters.check(result, bf16, bf16_refs, world)
    print("\n".join(rows))
    return rows


@pytest.mark.distributed
def test_two_ranks(tmp_path: Path) -> None:
    run_both(tmp_path, 2, tied_pp.LAYOUTS_2[:1], bf16_masters.LAYOUTS_2[:2])


@pytest.mark.distributed
def test_four_ranks(tmp_path: Path) -> None:
    run_both(tmp_path, 4, tied_pp.LAYOUTS_4[:1], bf16_masters.LAYOUTS_4[:1])
