"""How often each sharded layout reduces gradients in a step with accumulation, as the trainer
runs it and as the planner times it (`plan.search._dp_exposed`), counted on 4 gloo ranks:

- HSDP (2 replicas x 2 shards) all-reduces across the replicas once per step, not once per
  micro-batch (FSDP2's `set_requires_all_reduce`, `Parallelism.micro_batch_sync`), and the
  gradients are the same on every rank;
- FSDP without PP reduce-scatters every micro-batch (its gradients stay sharded);
- FSDP under PP reduce-scatters once per step (torch's schedule defers the reduction to after
  the stage's last backward), or once per schedule run with `parallel.pp_microbatches`, which
  also bounds torch's receive buffers to the micro-batches of a run.

Loss and gradient parity of these layouts with accumulation against one process is in
`tests/parallel/distributed/test_parity.py` and the parity matrix."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from tests.helpers.dist_worker import BASE, MODEL, full_grads, train_steps
from tests.helpers.proc import run_ranks
from tests.helpers.trainer import tiny_config

LAYOUTS = {
    "hsdp": ["--parallel.dp_replicate", "2", "--parallel.dp_shard", "2"],
    "fsdp": ["--parallel.dp_shard", "4"],
    "pp-x-fsdp": ["--parallel.pp", "2", "--parallel.dp_shard", "2",
                  "--parallel.pp_schedule", "1F1B"],
    # two schedule runs of 2 micro-batches per step at 4 (`parallel.pp_microbatches`)
    "pp-x-fsdp-runs": ["--parallel.pp", "2", "--parallel.dp_shard", "2",
                       "--parallel.pp_schedule", "1F1B", "--parallel.pp_microbatches", "2"],
}


def _count_step(trainer: object) -> dict[str, int]:
    """Reduce-scatters, and all-reduces over the replicas' group, in one training step."""
    calls = {"reduce_scatter": 0, "replica_all_reduce": 0}
    replicas = (trainer.par.mesh.group("dp_replicate")  # type: ignore[attr-defined]
                if trainer.par.dims.dp_replicate > 1 else None)  # type: ignore[attr-defined]
    all_reduce, reduce_scatter = dist.all_reduce, dist.reduce_scatter_single

    def counting_all_reduce(*args, **kwargs):  # type: ignore[no-untyped-def]
        if replicas is not None and kwargs.get("group") is replicas:
            calls["replica_all_reduce"] += 1
        return all_reduce(*args, **kwargs)

    def counting_reduce_scatter(*args, **kwargs):  # type: ignore[no-untyped-def]
        calls["reduce_scatter"] += 1
        return reduce_scatter(*args, **kwargs)

    dist.all_reduce, dist.reduce_scatter_single = counting_all_reduce, counting_reduce_scatter
    try:
        train_steps(trainer, 1, None)
    finally:
        dist.all_reduce, dist.reduce_scatter_single = all_reduce, reduce_scatter
    return calls


def _entry(rank: int, world: int, out_dir: str, cache: str) -> None:
    from scaletrain.train.trainer import Trainer

    dist.init_process_group("gloo", rank=rank, world_size=world)
    out: dict = {}
    for name, flags in LAYOUTS.items():
        for ga in (2, 4) if name != "pp-x-fsdp-runs" else (4,):  # 1F1B needs pp micro-batches
            cfg = tiny_config(Path(out_dir) / f"{name}-ga{ga}", Path(cache), *MODEL, *BASE,
                              *flags, "--training.grad_accum_steps", str(ga),
                              "--training.steps", "2")
            trainer = Trainer(cfg)
            out[name, ga] = _count_step(trainer)
            if trainer.par.dims.pp > 1:  # torch's receive buffers: one per micro-batch of a run
                out[name, ga]["receive_buffers"] = sum(
                    len(stage.args_recv_info) for stage in trainer.par.stages)
            if name == "hsdp" and ga == 4:  # the next step's reduced gradients, before the update
                _, out["hsdp grads"] = train_steps(trainer, 1,
                                                   lambda t=trainer: full_grads(t.model))
            dist.barrier()
    torch.save(out, Path(out_dir) / f"rank{rank}.pt")


@pytest.mark.distributed
def test_reductions_per_step_with_accumulation(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    cache.mkdir()
    run_ranks(_entry, 4, str(tmp_path), str(cache))
    results = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(4)]
    for r in results:
        hsdp2, hsdp4 = r["hsdp", 2], r["hsdp", 4]
        assert hsdp2["replica_all_reduce"] > 0  # one per FSDP unit
        assert hsdp4["replica_all_reduce"] == hsdp2["replica_all_reduce"], r  # not 2x
        assert hsdp4["reduce_scatter"] == 2 * hsdp2["reduce_scatter"] > 0
        assert r["fsdp", 4]["reduce_scatter"] == 2 * r["fsdp", 2]["reduce_scatter"] > 0
        assert r["pp-x-fsdp", 4]["reduce_scatter"] == r["pp-x-fsdp", 2]["reduce_scatter"] > 0
        # in runs of 2: a reduction per run, and the receive buffers of 2 micro-batches
        runs = r["pp-x-fsdp-runs", 4]
        assert runs["reduce_scatter"] == 2 * r["pp-x-fsdp", 4]["reduce_scatter"]
        assert runs["receive_buffers"] == r["pp-x-fsdp", 2]["receive_buffers"] \
            == r["pp-x-fsdp", 4]["receive_buffers"] // 2 > 0
    # every rank holds the same full gradients: the replicas' sums were all-reduced
    for name, g in results[0]["hsdp grads"].items():
        for r in results[1:]:
            torch.testing.assert_close(r["hsdp grads"][name], g, rtol=0, atol=0)
