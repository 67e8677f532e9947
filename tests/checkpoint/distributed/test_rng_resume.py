"""Dropout across a resume on 2 ranks (DDP and FSDP ZeRO-3): 2 steps, checkpoint, resume, 2
more steps equal 4 uninterrupted steps, because each rank's own RNG state comes back (DCP
keeps one copy of an entry every rank writes under the same key: with one shared "rng" entry
rank 1 resumed with rank 0's state and drew other masks)."""

from __future__ import annotations

from pathlib import Path

import pytest

from scaletrain.checkpoint.safe_dcp import read_metadata
from tests.helpers.dist_worker import spawn

TOL = 1e-6
DROPOUT = ["--model.dropout", "0.1", "--training.grad_accum_steps", "2",
           "--training.micro_batch_size", "2"]
MODES = ("ddp", "zero3")


@pytest.mark.distributed
def test_dropout_run_resumed_on_two_ranks_equals_the_uninterrupted_run(tmp_path: Path) -> None:
    cache = str(tmp_path / "cache")

    def argv(mode: str, run: str, *extra: str) -> list[str]:
        return [str(tmp_path / f"{run}-{mode}"), cache, *DROPOUT, "--parallel.data_parallel",
                mode, "--training.steps", "4", *extra]

    for d in ("a", "b"):
        (tmp_path / d).mkdir()
    full = spawn(2, [(f"full-{m}", argv(m, "full")) for m in MODES], 4, tmp_path / "a")[0]
    jobs = []
    for m in MODES:
        jobs += [(f"save-{m}", argv(m, "split"), {"save": True, "capture": False}),
                 (f"resume-{m}", argv(m, "split", "--checkpoint.resume", "true"),
                  {"capture": False})]
    split = spawn(2, jobs, 2, tmp_path / "b")[0]
    for m in MODES:
        losses = split[f"save-{m}"]["losses"] + split[f"resume-{m}"]["losses"]
        ref = full[f"full-{m}"]["losses"]
        diff = max(abs(a - b) for a, b in zip(losses, ref, strict=True))
        assert diff <= TOL, (m, losses, ref)
        keys = set(read_metadata(split[f"save-{m}"]["checkpoint"]).state_dict_metadata)
        assert {"extra.rng.rank0.torch", "extra.rng.rank1.torch"} <= keys, m
