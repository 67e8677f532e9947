"""HSDP with gradient accumulation all-reduces across the replicas once per step, not once per
micro-batch (FSDP2's `set_requires_all_reduce`, `Parallelism.micro_batch_sync`), and the
gradients are those of one process (4 gloo ranks: 2 replicas x 2 shards). The loss and
gradient parity of HSDP with accumulation against one process is also in
`tests/distributed/test_parity.py` (`hsdp`) and the parity matrix."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from tests.distributed.worker import BASE, MODEL, full_grads, train_steps
from tests.proc_helpers import run_ranks
from tests.trainer_helpers import tiny_config

HSDP = ["--parallel.dp_replicate", "2", "--parallel.dp_shard", "2"]


def _replica_all_reduces(trainer: object, group: dist.ProcessGroup) -> int:
    """All-reduces over the replicas' group during one training step."""
    calls = []
    original = dist.all_reduce

    def counting(*args, **kwargs):  # type: ignore[no-untyped-def]
        if kwargs.get("group") is group:
            calls.append(1)
        return original(*args, **kwargs)

    dist.all_reduce = counting
    try:
        train_steps(trainer, 1, None)
    finally:
        dist.all_reduce = original
    return len(calls)


def _entry(rank: int, world: int, out_dir: str, cache: str) -> None:
    from scaletrain.train.trainer import Trainer

    dist.init_process_group("gloo", rank=rank, world_size=world)
    out = {}
    for ga in (1, 4):
        cfg = tiny_config(Path(out_dir) / f"ga{ga}", Path(cache), *MODEL, *BASE, *HSDP,
                          "--training.grad_accum_steps", str(ga), "--training.steps", "2")
        trainer = Trainer(cfg)
        group = trainer.par.mesh.group("dp_replicate")
        out[f"calls_ga{ga}"] = _replica_all_reduces(trainer, group)
        if ga == 4:  # the first step's reduced gradients, before the update
            _, grads = train_steps(trainer, 1, lambda t=trainer: full_grads(t.model))
            out["grads"] = grads
        dist.barrier()
    torch.save(out, Path(out_dir) / f"rank{rank}.pt")


@pytest.mark.distributed
def test_hsdp_all_reduces_once_per_step_whatever_the_accumulation(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    cache.mkdir()
    run_ranks(_entry, 4, str(tmp_path), str(cache))
    results = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(4)]
    for r in results:
        assert r["calls_ga1"] > 0  # one per FSDP unit
        assert r["calls_ga4"] == r["calls_ga1"], r  # not 4x
    # every rank holds the same full gradients: the replicas' sums were all-reduced
    for name, g in results[0]["grads"].items():
        for r in results[1:]:
            torch.testing.assert_close(r["grads"][name], g, rtol=0, atol=0)
