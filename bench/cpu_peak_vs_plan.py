"""CPU training peak per rank, measured, against the plan `train --dry-run` prints.

    python bench/cpu_peak_vs_plan.py        # table + bench/results/cpu_peak_vs_plan.{json,txt}
    LAYOUTS="PP2 1F1B,PP2 GPipe" TAG=_pp python bench/cpu_peak_vs_plan.py pinned  # some of them

For one process, DDP (2 ranks), ZeRO-3 (2 ranks), TP 2 x DP 2 (4 ranks) and two pipeline
stages (1F1B and GPipe, 4 micro-batches; each rank against its own stage's plan) on the `debug`
preset (bf16 autocast where the CPU has AVX-512 bf16, as `train` picks it), every rank builds
the real `Trainer` (under torchrun, gloo) and runs 3 steps. Measured: the trainer's own
`peak_mem_gib` quantity, the peak resident set size (VmHWM, reset at the trainer's memory
baseline) above that baseline. Planned: `plan.from_config.plan_config` on the same config and
world size, as `train --dry-run` computes it.

The peak is taken twice, with glibc's allocator as it comes and with its mmap threshold
pinned at 128 KiB (`MALLOC_MMAP_THRESHOLD_=131072`, which also switches off glibc's dynamic
threshold), so that every freed tensor of 128 KiB or more goes back to the system at once:
- `pinned`: the resident set follows what the trainer allocates; the plan is checked
  against this one (`tests/plan/memory/distributed/test_cpu_peak.py`);
- `glibc default`: the difference is heap fragmentation: glibc raises its threshold to the
  largest block freed (up to 32 MiB), serves smaller blocks from its heap and keeps the freed
  ones resident where later blocks do not fit;
- `tiny`: the same layout, pinned, with a tiny model (dim 64, 2 layers, vocab 512, 32 tokens)
  whose tensors are a few MB: its peak is the process's own runtime (torch's pages, threads,
  gloo), which `plan/memory/host.py` carries as `host_runtime`.

Both variants turn the trainer's own allocator policy off (`training.cpu_mmap_threshold_mb 0`,
`training.cpu_malloc_trim false`); `bench/cpu_malloc_policy.py` measures the runs with it, as
users run them.

A rank's peak is read from /proc (Linux only). The page faults while training (minor faults,
`getrusage`) show what pinning costs: every freed block comes back as fresh pages to fault in
and zero (CPU seconds are recorded too, but on a shared machine only the faults are steady).
"""

from __future__ import annotations

import json
import os
import resource
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench._spawn

RESULTS = Path(__file__).parent / "results"
LAYOUTS = {  # name: (ranks, flags)
    "one process": (1, []),
    "DDP 2": (2, ["--parallel.data_parallel", "ddp"]),
    "ZeRO-3 2": (2, ["--parallel.data_parallel", "zero3"]),
    "TP2 x DP2": (4, ["--parallel.tp", "2", "--parallel.data_parallel", "ddp"]),
    "PP2 1F1B": (2, ["--parallel.pp", "2", "--parallel.pp_schedule", "1F1B",
                     "--training.grad_accum_steps", "4"]),
    "PP2 GPipe": (2, ["--parallel.pp", "2", "--parallel.pp_schedule", "GPipe",
                      "--training.grad_accum_steps", "4"]),
}
TINY = ["--model.dim", "64", "--model.n_layers", "2", "--model.n_heads", "4",
        "--model.n_kv_heads", "2", "--model.ffn_dim", "128", "--model.vocab_size", "512",
        "--data.vocab_size", "512",
        "--data.seq_len", "32"]


def common_flags(output: Path, cache: Path, steps: int = 3) -> list[str]:
    """The debug preset with a small corpus, no evaluation, checkpoint or sample."""
    return ["--output", str(output), "--data.cache_dir", str(cache),
            "--data.max_bytes", "400000", "--data.curate", "false",
            "--training.steps", str(steps), "--training.eval_interval", "0",
            "--training.sample_tokens", "0", "--checkpoint.interval", "0",
            "--metrics.tensorboard", "false", "--metrics.progress_bar", "false"]


def planned_peak(plan: object, trainer: object) -> int:
    """The plan's peak of this rank: its own pipeline stage's under PP (rank 0 holds the
    embedding, the last stage the head and the loss), else the plan's (every rank alike)."""
    stages = plan.stages  # type: ignore[attr-defined]
    if not stages:
        return plan.peak_bytes  # type: ignore[attr-defined]
    return stages[trainer.par.pp_rank]["memory_bytes"]["peak"]  # type: ignore[attr-defined]


def _status_bytes(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    return 0


def worker(out_dir: str, argv: list[str]) -> None:
    """One rank: plan, build the trainer, train, write this rank's figures."""
    import logging

    logging.disable(logging.WARNING)
    from scaletrain.config import load_config
    from scaletrain.plan.from_config import plan_config
    from scaletrain.runtime import resolve_device
    from scaletrain.train.trainer import Trainer

    cfg = load_config(argv)
    plan, _ = plan_config(cfg, resolve_device(cfg.training.device))
    trainer = Trainer(cfg)
    file_at_baseline = _status_bytes("RssFile")
    faults, cpu = resource.getrusage(resource.RUSAGE_SELF).ru_minflt, time.process_time()
    trainer.train()
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults
    cpu = time.process_time() - cpu
    rank = int(os.environ.get("RANK", "0"))
    record = {"rank": rank, "measured": int(trainer.mem_baseline.peak_above_gib() * 2**30),
              "baseline": trainer.mem_baseline.bytes, "planned": planned_peak(plan, trainer),
              "rss_file_growth": _status_bytes("RssFile") - file_at_baseline,
              "train_page_faults": faults, "train_cpu_s": cpu,
              "memory_bytes": plan.memory_bytes}
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(record))


def launch(ranks: int, flags: list[str], env: dict[str, str]) -> list[dict]:
    """Run the worker on `ranks` processes; each rank's record."""
    from bench._spawn import torchrun_records

    return torchrun_records(__file__, ranks, flags, env)


def main() -> None:
    root = Path(__file__).parents[1]
    base_env = {**os.environ, "PYTHONPATH": str(root), "OMP_NUM_THREADS": "1",
                "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    pinned = {"MALLOC_MMAP_THRESHOLD_": "131072"}
    # the trainer's own allocator policy off (bench/cpu_malloc_policy.py measures it)
    off = ["--training.cpu_mmap_threshold_mb", "0", "--training.cpu_malloc_trim", "false"]
    variants = {"pinned": (pinned, off), "glibc default": ({}, off),
                "tiny": (pinned, [*TINY, *off])}
    if len(sys.argv) > 1:  # e.g. `tiny`: only those variants
        variants = {k: v for k, v in variants.items() if k in sys.argv[1:]}
    chosen = os.environ.get("LAYOUTS")  # e.g. "PP2 1F1B,PP2 GPipe"
    layouts = {k: v for k, v in LAYOUTS.items() if not chosen or k in chosen.split(",")}
    tag = os.environ.get("TAG", "")
    rows, lines = [], []
    with tempfile.TemporaryDirectory() as cache:
        for name, (ranks, flags) in layouts.items():
            for variant, (extra_env, extra) in variants.items():
                records = launch(ranks, [*common_flags(Path(cache, "unused"), Path(cache)),
                                         *flags, *extra], {**base_env, **extra_env})
                for r in records:
                    rows.append({"layout": name, "variant": variant, **r,
                                 "error": r["planned"] / r["measured"] - 1})
                line = f"{name:12s} {variant:14s} " + "  ".join(
                    f"r{r['rank']} {r['measured'] / 2**20:6.1f}/{r['planned'] / 2**20:6.1f} MiB "
                    f"({r['planned'] / r['measured'] - 1:+.1%}, "
                    f"{r['train_page_faults'] / 1000:.0f}k faults)" for r in records)
                lines.append(line)
                print(line, flush=True)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"cpu_peak_vs_plan{tag}.json").write_text(json.dumps(rows, indent=1))
    head = ("layout       variant        per rank: measured/planned peak above the baseline "
            "(planned/measured - 1, page faults while training 3 steps)")
    (RESULTS / f"cpu_peak_vs_plan{tag}.txt").write_text("\n".join([head, *lines]) + "\n")


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "--worker":
        worker(sys.argv[2], sys.argv[3:])
    else:
        main()
