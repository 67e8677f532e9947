"""torch.compile (per block) under tensor + sequence parallelism trains like one eager process;
under expert parallelism like the eager layout.

The first compiled block used to receive the embedding's `DTensor.to_local()` view, whose
gradient then skipped the DTensor conversion in backward (a plain tensor reached the
embedding's redistribute); `Parallelism.build_model` now hands it a copy."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers.dist_worker import run_trainer, spawn


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


@pytest.mark.distributed
def test_compiled_expert_parallel_matches_eager(tmp_path: Path) -> None:
    """EP 2 over FSDP 2 with a fp32 MoE: compilation used to stop on the expert weights (a
    DTensor reached the grouped GEMM) and on the traced grouped GEMM's bf16-only check."""
    cache = tmp_path / "cache"
    moe = ["--model.n_experts", "4", "--model.n_experts_per_token", "2",
           "--model.moe_ffn_dim", "64", "--model.moe_aux_loss_coef", "0.01",
           "--parallel.ep", "2", "--parallel.dp_shard", "2"]
    jobs = [(name, [str(tmp_path / name), str(cache), *moe, *flags])
            for name, flags in (("eager", []), ("compiled", ["--compile.enabled", "true"]))]
    for rank in spawn(2, jobs, 2, tmp_path):
        eager, compiled = rank["eager"]["losses"], rank["compiled"]["losses"]
        assert compiled == pytest.approx(eager, rel=1e-6), (compiled, eager)
