"""What keeping the blocks gathered costs under zero-bubble pipeline schedules with ZeRO-3.

Zero-bubble schedules split each micro-batch's backward into an input pass and a later weight
pass; FSDP must keep the blocks of a rank's stages gathered from forward to backward for the
weight pass to see them (`parallel.feasibility.reshards_after_forward`). This bench trains
a few steps of an 8-layer model on 4 CPU ranks (pp 2 x dp_shard 2, 2 virtual stages, 4
micro-batches) and reports, per rank, the largest number of parameter bytes held gathered
(unsharded) by FSDP at any block boundary of the forward passes, and the CPU allocator's peak
above the start of a step (torch.profiler memory events), for:
- `zero3 1F1B`: blocks freed after each forward (ZeRO-3 as elsewhere);
- `zero3 ZBV before`: the old behaviour, freed after forward (its gradients were wrong);
- `zero3 ZBV`: what runs now (kept gathered);
- `zero2 ZBV`: ZeRO-2 for comparison;
and the planner's `gathered_weights + comm_buffers` for each layout on the same model.

    python bench/zb_fsdp_memory_cpu.py

Raw output: bench/results/zb_fsdp_memory_cpu.json.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.fused_loss_tp_cpu import free_port, peak_above_start  # noqa: E402

RESULTS = ROOT / "bench" / "results" / "zb_fsdp_memory_cpu.json"
MODEL = ["--model.dim", "256", "--model.n_layers", "8", "--model.n_heads", "4",
         "--model.n_kv_heads", "2", "--model.ffn_dim", "768", "--model.vocab_size", "512",
         "--model.tie_embeddings", "false"]
LAYOUTS = {
    "zero3 1F1B": ["--parallel.data_parallel", "zero3", "--parallel.pp_schedule", "1F1B"],
    "zero3 ZBV before": ["--parallel.data_parallel", "zero3", "--parallel.pp_schedule",
                         "ZBVZeroBubble", "--parallel.pp_virtual_stages", "2"],
    "zero3 ZBV": ["--parallel.data_parallel", "zero3", "--parallel.pp_schedule",
                  "ZBVZeroBubble", "--parallel.pp_virtual_stages", "2"],
    "zero2 ZBV": ["--parallel.data_parallel", "zero2", "--parallel.pp_schedule",
                  "ZBVZeroBubble", "--parallel.pp_virtual_stages", "2"],
}
MIB = 2**20


def _argv(out: Path, cache: Path, layout: list[str]) -> list[str]:
    return ["--output", str(out), *MODEL, "--data.cache_dir", str(cache),
            "--data.vocab_size", "512", "--data.seq_len", "64", "--data.max_bytes", "400000",
            "--data.curate", "false", "--training.steps", "3", "--training.micro_batch_size",
            "2", "--training.grad_accum_steps", "4", "--training.eval_interval", "0",
            "--training.sample_tokens", "0", "--checkpoint.save_final", "false",
            "--metrics.tensorboard", "false", "--metrics.progress_bar", "false",
            "--parallel.pp", "2", "--parallel.dp_shard", "2", *layout]


def _gathered_bytes(model: torch.nn.Module) -> int:
    """Bytes of the block parameters FSDP holds gathered now (plain tensors, not shards)."""
    from torch.distributed.tensor import DTensor

    return sum(p.numel() * p.element_size() for block in model.layers.values()
               for p in block.parameters() if not isinstance(p, DTensor))


class _PeakGathered:
    """A forward hook (after FSDP's own, which frees a block under ZeRO-3): the most block
    parameter bytes held gathered at once."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model, self.bytes = model, 0

    def __call__(self, *_: Any) -> None:
        self.bytes = max(self.bytes, _gathered_bytes(self.model))


def _rank(rank: int, port: int, tmp: str, out: dict[str, Any]) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE="4", LOCAL_RANK=str(rank),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    import scaletrain.parallel.parallelize as par_lib
    from scaletrain.config import load_config
    from scaletrain.train.trainer import Trainer

    fixed = par_lib.reshards_after_forward
    rows = {}
    for name, layout in LAYOUTS.items():
        par_lib.reshards_after_forward = (lambda mode, pp, s: mode == "zero3") \
            if name.endswith("before") else fixed
        trainer = Trainer(load_config(_argv(Path(tmp) / name.replace(" ", "-"),
                                            Path(tmp) / "cache", layout)))
        peak = _PeakGathered(trainer.model)
        for block in trainer.model.layers.values():
            block.register_forward_hook(peak)
        trainer.train_step(trainer.next_batches())  # warm-up (shape inference)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU],
                                    profile_memory=True) as prof:
            trainer.train_step(trainer.next_batches())
        rows[name] = {"gathered_mib": peak.bytes / MIB,
                      "allocator_peak_mib": peak_above_start(prof)}
        torch.distributed.barrier()
    out[rank] = rows


def _planned() -> dict[str, float]:
    from scaletrain.config import load_config
    from scaletrain.parallel.dims import ParallelDims
    from scaletrain.plan.estimate import estimate
    from scaletrain.plan.layout import Layout
    from scaletrain.plan.memory.states import stage_params

    args = load_config(_argv(Path("x"), Path("y"), [])).model.to_model_args()
    out = {"one block": stage_params(args).per_layer * 4 / MIB}
    for name, zero, schedule in (("zero3 1F1B", 3, "1F1B"), ("zero3 ZBV", 3, "ZBVZeroBubble"),
                                 ("zero2 ZBV", 2, "ZBVZeroBubble")):
        lay = Layout(dims=ParallelDims(pp=2, dp_shard=2), mbs=2, seq_len=64, gbs=16, zero=zero,
                     schedule=schedule, vpp=1 if schedule == "1F1B" else 2, precision="fp32",
                     kernels="cpu")
        mem = estimate(args, lay).memory_bytes
        out[name] = (mem["gathered_weights"] + mem["comm_buffers"]) / MIB
    return out


def main(results: Path = RESULTS) -> dict[str, Any]:
    port = free_port()
    with tempfile.TemporaryDirectory() as tmp, mp.Manager() as manager:
        out = manager.dict()
        mp.spawn(_rank, args=(port, tmp, out), nprocs=4)
        ranks = dict(out)
    planned = _planned()
    print(f"one block: {planned['one block']:.2f} MiB of fp32 parameters; a rank holds 4 blocks")
    print("| layout | rank | gathered block params (MiB) | allocator peak (MiB) | "
          "planned gathered + buffers (MiB) |\n|---|---|---|---|---|")
    for name in LAYOUTS:
        for rank in sorted(ranks):
            r = ranks[rank][name]
            plan = planned.get(name.replace(" before", ""), float("nan"))
            print(f"| {name} | {rank} | {r['gathered_mib']:.2f} | "
                  f"{r['allocator_peak_mib']:.1f} | {plan:.2f} |")
    out = {"ranks": ranks, "planned_mib": planned}
    results.write_text(json.dumps(out, indent=2) + "\n")
    return out


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--results", type=Path, default=RESULTS, help="raw JSON output")
    main(parser.parse_args().results)
