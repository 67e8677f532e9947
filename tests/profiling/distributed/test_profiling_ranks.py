"""`scaletrain diagnose` on real traces of 2 gloo ranks (DDP, the trainer's phase names), one
rank slowed on purpose: a data loader that sleeps, then a forward pass with extra matrix
products. The verdict must name the slow rank and what slows it; the other rank, which waits
in its all-reduce, is communication-bound on its own."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from scaletrain.profiling.analyze import analyze
from tests.helpers.proc import run_ranks

SLEEP_S = 0.08


def _ranks(rank: int, world: int, out: str) -> None:
    """Two profiled runs of 4 steps: rank 1's data loader sleeps; then rank 0 computes more."""
    from scaletrain.profiling.capture import phase

    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.GELU(),
                                torch.nn.Linear(1024, 256))
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
    extra = torch.randn(1024, 1024)
    for case, slow in (("data", 1), ("compute", 0)):
        def ready(p: torch.profiler.profile, case: str = case) -> None:
            p.export_chrome_trace(str(Path(out) / case / f"rank{rank}.pt.trace.json"))

        sched = torch.profiler.schedule(wait=0, warmup=1, active=3)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU],
                                    schedule=sched, on_trace_ready=ready) as prof:
            for _ in range(4):
                with phase("data"):
                    x = torch.randn(64, 256)
                    if case == "data" and rank == slow:
                        time.sleep(SLEEP_S)
                with phase("forward"):
                    loss = ddp(x).pow(2).mean()
                    if case == "compute" and rank == slow:
                        y = torch.randn(256, 1024)
                        for _ in range(8):
                            y = torch.tanh(y @ extra)
                        loss = loss + 0 * y.sum()
                with phase("backward"):
                    loss.backward()
                with phase("optimizer"):
                    opt.step()
                    opt.zero_grad()
                prof.step()
        dist.barrier()
    dist.destroy_process_group()


@pytest.mark.distributed
def test_the_verdict_names_the_slow_rank_and_its_cause(tmp_path: Path) -> None:
    for case in ("data", "compute"):
        (tmp_path / case).mkdir()
    run_ranks(_ranks, 2, str(tmp_path), timeout_s=300)
    r = analyze(sorted((tmp_path / "data").glob("rank*.json")))
    assert r["across_ranks"]["straggler_rank"] == 1, r["across_ranks"]
    assert r["verdict"] == "input-bound", r["evidence"]
    assert r["ranks"][0]["verdict"] == "communication-bound"  # waits for rank 1
    assert r["ranks"][1]["step_ms"] > 1e3 * SLEEP_S
    r = analyze(sorted((tmp_path / "compute").glob("rank*.json")))
    assert r["across_ranks"]["straggler_rank"] == 0, r["across_ranks"]
    assert r["verdict"] == "compute-bound", r["evidence"]
    assert r["ranks"][1]["verdict"] == "communication-bound"
