"""Mixture-of-Experts throughput: grouped-GEMM experts against a per-expert loop, and expert
parallelism against one process.

Part 1 times forward + backward of a `debug-moe`-sized model (and a wider MoE block) with
`expert_compute="grouped"` (one `torch._grouped_mm`) and `"loop"` (one matmul per expert), the
median over `--iters` after `--warmup`. Part 2 trains `debug-moe` for `--steps` steps through
the trainer: one process, 2 ranks data parallel (FSDP, experts replicated per rank) and 2 ranks
with `--parallel.ep 2` (each rank holds half the experts; tokens travel by all-to-all), the
same global batch, and reads the job's tokens/s from metrics.jsonl (steps after the first 2).
With `--four-ranks` it adds 4-rank rows with tensor parallelism: FSDP 2 x TP 2 (experts split
over the TP ranks) and FSDP 2 x TP 2 + `--parallel.ep 2` (experts over ep x tp,
`parallel/ep_tp.py`), the same global batch again. Each row also gives rank 0's peak resident
memory above its start (`peak_mem_gib` of metrics.jsonl) and the planner's per-rank model
state (weights + gradients + AdamW state) for that layout.

    python bench/moe_cpu.py                      # both parts, CPU
    python bench/moe_cpu.py --part layouts --four-ranks
    python bench/moe_cpu.py --part kernels --device cuda

Prints a table and writes raw JSON (default bench/results/moe_cpu.json).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from scaletrain.models.args import get_preset  # noqa: E402
from scaletrain.models.transformer import build_model  # noqa: E402

RESULTS = ROOT / "bench" / "results" / "moe_cpu.json"
SHAPES = {
    "debug-moe": get_preset("debug-moe"),
    "wide-moe": get_preset("debug-moe").replace(dim=512, n_heads=8, n_kv_heads=4, n_experts=16,
                                               moe_ffn_dim=1024, n_layers=2),
}


def time_kernels(device: str, batch: int, seq: int, iters: int, warmup: int,
                 dtype: str) -> list[dict[str, Any]]:
    rows = []
    autocast = torch.autocast(device, dtype=torch.bfloat16, enabled=dtype == "bf16")
    for name, args in SHAPES.items():
        for compute in ("grouped", "loop"):
            model = build_model(args.replace(expert_compute=compute), device, seed=0)
            x = torch.randint(0, args.vocab_size, (batch, seq), device=device)
            times = []
            for i in range(warmup + iters):
                if device == "cuda":
                    torch.cuda.synchronize()
                t0 = time.perf_counter()
                with autocast:
                    logits = model(x)
                torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(),
                                                  x.flatten()).backward()
                if device == "cuda":
                    torch.cuda.synchronize()
                if i >= warmup:
                    times.append(time.perf_counter() - t0)
                model.zero_grad(set_to_none=True)
            t = statistics.median(times)
            rows.append({"model": name, "experts": compute, "dtype": dtype,
                         "tokens_per_s": batch * seq / t, "step_s": t})
    return rows


def _train(out: Path, cache: Path, nproc: int, steps: int, extra: list[str]) -> float:
    argv = ["--output", str(out), "--model.name", "debug-moe", "--data.cache_dir", str(cache),
            "--data.seq_len", "256", "--data.max_bytes", "3000000", "--data.curate", "false",
            "--training.steps", str(steps), "--training.eval_interval", "0",
            "--training.eval_sequences", "8", "--training.sample_tokens", "0",
            "--checkpoint.save_final", "false", "--checkpoint.interval", "0",
            "--metrics.tensorboard", "false", "--metrics.progress_bar", "false",
            "--metrics.log_interval", "1", "--precision.dtype", "fp32", *extra]
    env = {**os.environ, "OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 2) // nproc)),
           "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1"}
    launcher = [sys.executable, "-m", "scaletrain", "train"] if nproc == 1 else [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
        str(nproc), "-m", "scaletrain", "train"]
    subprocess.run([*launcher, *argv], env=env, check=True, capture_output=True)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "tokens_per_s" in r]
    tail = rows[2:] or rows
    return (statistics.median(r["tokens_per_s"] for r in tail),
            max((r.get("peak_mem_gib") or 0.0) for r in rows))


def _plan_mib(nproc: int, tp: int, ep: int, mbs: int) -> tuple[float, float]:
    """The planner's per-rank model state (weights + gradients + AdamW state, fp32) and FSDP
    buffers (a gathered block, its prefetched successor, its unsharded gradients: EP gathers
    only the rank's own experts) of debug-moe, in MiB."""
    from scaletrain.parallel.dims import ParallelDims
    from scaletrain.plan.estimate import estimate
    from scaletrain.plan.layout import Layout

    dims = ParallelDims.resolve(nproc, dp_shard=-1, tp=tp, ep=ep)
    plan = estimate(get_preset("debug-moe"), Layout(
        dims=dims, mbs=mbs, seq_len=256, gbs=mbs * dims.dp, zero=3 if nproc > 1 else 0,
        precision="fp32", param_dtype="fp32", kernels="cpu"))
    m = plan.memory_bytes
    state = m["weights"] + m["gradients"] + m["master_weights"] + m["optimizer"]
    return state / 2**20, m["comm_buffers"] / 2**20


def time_layouts(steps: int, mbs: int, four: bool = False) -> list[dict[str, Any]]:
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        cache = Path(tmp) / "cache"
        # name, processes, tp, ep, per-rank micro-batch (global batch 2 x mbs everywhere)
        runs = [("one process", 1, 1, 1, 2 * mbs),
                ("2 ranks, FSDP (ep 1)", 2, 1, 1, mbs),
                ("2 ranks, FSDP + ep 2", 2, 1, 2, mbs)]
        if four:
            runs += [("4 ranks, FSDP 2 x TP 2", 4, 2, 1, mbs),
                     ("4 ranks, FSDP 2 x TP 2 + ep 2", 4, 2, 2, mbs)]
        _train(Path(tmp) / "warm", cache, 1, 2, [])  # builds the token cache once
        for name, nproc, tp, ep, rank_mbs in runs:
            extra = ["--training.micro_batch_size", str(rank_mbs), "--parallel.tp", str(tp),
                     "--parallel.ep", str(ep)]
            tps, peak = _train(Path(tmp) / name.replace(" ", "_"), cache, nproc, steps, extra)
            state, buffers = _plan_mib(nproc, tp, ep, rank_mbs)
            rows.append({"layout": name, "processes": nproc, "tokens_per_s": tps,
                         "global_batch": 2 * mbs, "rank0_peak_rss_gib": peak,
                         "plan_model_state_mib_per_rank": state,
                         "plan_fsdp_buffers_mib_per_rank": buffers})
    return rows


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--part", choices=["all", "kernels", "layouts"], default="all")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--mbs", type=int, default=4, help="per-rank micro-batch of part 2")
    p.add_argument("--four-ranks", action="store_true",
                   help="part 2 also runs 4-rank FSDP x TP and FSDP x TP + EP (EP x TP)")
    p.add_argument("--out", default=str(RESULTS))
    a = p.parse_args(argv)
    result: dict[str, Any] = {"machine": platform.processor() or platform.machine(),
                              "cpus": os.cpu_count(), "torch": torch.__version__,
                              "device": a.device}
    if a.part in ("all", "kernels"):
        result["kernels"] = time_kernels(a.device, a.batch, a.seq, a.iters, a.warmup, a.dtype)
        print(f"{'model':<10} {'experts':<8} {'tokens/s':>10} {'step s':>8}")
        for r in result["kernels"]:
            print(f"{r['model']:<10} {r['experts']:<8} {r['tokens_per_s']:>10,.0f} "
                  f"{r['step_s']:>8.3f}")
    if a.part in ("all", "layouts"):
        result["layouts"] = time_layouts(a.steps, a.mbs, a.four_ranks)
        print(f"\n{'layout':<30} {'tokens/s (job)':>15} {'rank-0 peak RSS GiB':>20} "
              f"{'plan state MiB/rank':>20} {'plan FSDP buffers MiB':>22}")
        for r in result["layouts"]:
            print(f"{r['layout']:<30} {r['tokens_per_s']:>15,.0f} "
                  f"{r['rank0_peak_rss_gib']:>20.2f} "
                  f"{r['plan_model_state_mib_per_rank']:>20.1f} "
                  f"{r['plan_fsdp_buffers_mib_per_rank']:>22.1f}")
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
