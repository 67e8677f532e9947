"""torch.compile (per block) under tensor + sequence parallelism trains like one eager process.

The first compiled block used to receive the embedding's `DTensor.to_local()` view, whose
gradient then skipped the DTensor conversion in backward (a plain tensor reached the
embedding's redistribute); `Parallelism.build_model` now hands it a copy."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.distributed.worker import run_trainer, spawn


@pytest.mark.distributed
def test_compiled_tp_sp_matches_one_eager_process(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    ref = run_trainer([str(tmp_path / "ref"), str(cache)], 2, capture=False)
    jobs = [("compiled-tp", [str(tmp_path / "run"), str(cache), "--compile.enabled", "true",
                             "--parallel.tp", "2"])]
    got = spawn(2, jobs, 2, tmp_path)
    for rank in got:
        losses = rank["compiled-tp"]["losses"]
        assert losses == pytest.approx(ref["losses"], rel=1e-5), (losses, ref["losses"])
