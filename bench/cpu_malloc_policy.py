"""glibc allocator policies for CPU training: peak memory against the plan, and step CPU time.

    python bench/cpu_malloc_policy.py                  # the policies of POLICIES, 2 repeats
    python bench/cpu_malloc_policy.py default trainer  # only those policies
    REPEATS=3 STEPS=6 SEQ=256 LAYOUTS="one process,TP2 x DP2" TAG=_x python bench/...
    LAYOUTS="PP2 1F1B,PP2 GPipe" TAG=_pp python bench/cpu_malloc_policy.py \
        default trainer trainer@1 trainer@0.25

For the layouts of `bench/cpu_peak_vs_plan.py` (one process, DDP 2, ZeRO-3 2, TP 2 x DP 2 and
two pipeline stages; a pipeline rank against its own stage's plan) on the `debug`
preset at 128 tokens (`SEQ`; 128 is the setting of `tests/plan/memory/distributed/test_cpu_peak.py`;
bf16 autocast where the CPU has AVX-512 bf16), every rank builds the real `Trainer` under torchrun
(gloo). `trainer` runs the trainer's own policy (its defaults: `training.cpu_mmap_threshold_mb`
4, `training.cpu_malloc_trim` true, `train/host_allocator.py`: what `mmap4m+fwd` does, plus a
trim before the memory baseline), `trainer@N` the same with its threshold at N MiB; every
other policy turns the trainer's off and applies its
own before the trainer is built:

- `default`: glibc as it comes (dynamic mmap threshold, raised up to 32 MiB);
- `mmapNk` / `mmapNm`: `mallopt(M_MMAP_THRESHOLD, N KiB / MiB)` (which also stops the raise);
- `...+trim`: `malloc_trim(0)` after every optimizer step as well;
- `...+ftrim`: `malloc_trim(0)` after every forward pass of the model and every optimizer step;
- `...+fwd`: `malloc_trim(0)` after every forward pass only;
- `...+arena1`: `mallopt(M_ARENA_MAX, 1)` as well (one heap for every thread, gloo's included);
- `...+pad`: `M_TOP_PAD` 0 and `M_TRIM_THRESHOLD` 128 KiB as well (give the heap's top back).

Measured per rank: the trainer's `peak_mem_gib` quantity (the peak resident set, VmHWM, above
the baseline the trainer takes before building the model) against the plan `train --dry-run`
prints (`plan.from_config.plan_config`); minor page faults and CPU seconds (process time) of
each step. The CPU time per step is the median over steps 3.. (DDP has rebuilt its buckets);
the machine may be shared, so the load average is recorded with each run and every policy is
run `REPEATS` times, interleaved. Raw rows go to `bench/results/cpu_malloc_policy{TAG}.json`
(and one line per rank as it runs to `.jsonl`), the table to `.txt`.
"""

from __future__ import annotations

import json
import os
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench._spawn

from bench.cpu_peak_vs_plan import LAYOUTS, planned_peak  # noqa: E402  (the same layouts)

RESULTS = Path(__file__).parent / "results"
POLICIES = ["default", "trainer", "mmap4m+fwd", "mmap128k", "mmap512k", "mmap1m"]
"""The policies run when none is named (screens also ran mmap256k, mmap4m, mmap16m,
default+trim, mmap4m+arena1, mmap4m+pad, default+ftrim, mmap1m+ftrim:
bench/results/cpu_malloc_policy_screen*.txt; `cpu_malloc_policy.*` in bench/results holds a
sweep of the thresholds whose `trainer` rows were the earlier policy, mmap4m+ftrim)."""


def common_flags(output: Path, cache: Path, steps: int) -> list[str]:
    return ["--output", str(output), "--data.cache_dir", str(cache),
            "--data.max_bytes", "400000", "--data.seq_len", os.environ.get("SEQ", "128"),
            "--data.curate", "false",
            "--training.steps", str(steps), "--training.eval_interval", "0",
            "--training.sample_tokens", "0", "--checkpoint.interval", "0",
            "--metrics.tensorboard", "false", "--metrics.progress_bar", "false"]


def policy_flags(policy: str) -> list[str]:
    """`trainer`: the trainer's own policy (its defaults); `trainer@N`: with its threshold at
    N MiB (`training.cpu_mmap_threshold_mb`); any other: the trainer's off."""
    if policy == "trainer":
        return []
    if policy.startswith("trainer@"):
        return ["--training.cpu_mmap_threshold_mb", policy.removeprefix("trainer@")]
    return ["--training.cpu_mmap_threshold_mb", "0", "--training.cpu_malloc_trim", "false"]


def apply_policy(policy: str) -> bool:
    """The policy's mallopt calls; True when it trims after each step."""
    from scaletrain.train import host_allocator as ha

    if policy.startswith("trainer"):
        return False
    parts = policy.split("+")
    base = parts[0]
    if base.startswith("mmap"):
        size = int(base[4:-1]) * (2**10 if base.endswith("k") else 2**20)
        assert ha.mallopt(ha.M_MMAP_THRESHOLD, size), policy
    if "arena1" in parts:
        assert ha.mallopt(ha.M_ARENA_MAX, 1)
    if "pad" in parts:
        assert ha.mallopt(ha.M_TOP_PAD, 0) and ha.mallopt(ha.M_TRIM_THRESHOLD, 128 * 2**10)
    return "trim" in parts or "ftrim" in parts


def worker(out_dir: str, policy: str, argv: list[str]) -> None:
    """One rank: policy, plan, trainer, train with each step timed."""
    import logging

    logging.disable(logging.WARNING)
    trim = apply_policy(policy)  # before any tensor of the run, as the trainer does
    from scaletrain.config import load_config
    from scaletrain.plan.from_config import plan_config
    from scaletrain.runtime import resolve_device
    from scaletrain.train.host_allocator import malloc_trim
    from scaletrain.train.trainer import Trainer

    cfg = load_config(argv)
    plan, _ = plan_config(cfg, resolve_device(cfg.training.device))
    trainer = Trainer(cfg)
    steps: list[dict] = []
    run_step = trainer.run_step

    def timed_step(batches):  # type: ignore[no-untyped-def]
        f0, c0, w0 = (resource.getrusage(resource.RUSAGE_SELF).ru_minflt, time.process_time(),
                      time.perf_counter())
        out = run_step(batches)
        if trim:
            malloc_trim()
        out.loss.item()  # the step's work is done (CPU: it already is)
        steps.append({"faults": resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0,
                      "cpu_s": time.process_time() - c0, "wall_s": time.perf_counter() - w0})
        return out

    trainer.run_step = timed_step  # type: ignore[method-assign]
    if {"ftrim", "fwd"} & set(policy.split("+")):  # trim once the forward pass has returned
        for module in [trainer.model, *trainer.par.stage_modules]:  # stages: their own forward
            module.register_forward_hook(lambda *_: None if malloc_trim() else None)
    trainer.train()
    rank = int(os.environ.get("RANK", "0"))
    record = {"rank": rank, "measured": int(trainer.mem_baseline.peak_above_gib() * 2**30),
              "planned": planned_peak(plan, trainer), "steps": steps}
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(record))


def launch(ranks: int, policy: str, flags: list[str], env: dict[str, str]) -> list[dict]:
    from bench._spawn import torchrun_records

    return torchrun_records(__file__, ranks, [policy, *flags], env)


def main() -> None:
    root = Path(__file__).parents[1]
    env = {**os.environ, "PYTHONPATH": str(root), "OMP_NUM_THREADS": "1",
           "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    env.pop("MALLOC_MMAP_THRESHOLD_", None)
    policies = [p for p in sys.argv[1:]] or POLICIES
    repeats, steps = int(os.environ.get("REPEATS", "2")), int(os.environ.get("STEPS", "6"))
    layouts = os.environ.get("LAYOUTS")
    chosen = {k: v for k, v in LAYOUTS.items() if not layouts or k in layouts.split(",")}
    rows = []
    tag = os.environ.get("TAG", "")
    RESULTS.mkdir(exist_ok=True)
    with tempfile.TemporaryDirectory() as cache:
        for repeat in range(repeats):
            for name, (ranks, flags) in chosen.items():
                for policy in policies:
                    load = os.getloadavg()[0]
                    records = launch(ranks, policy, [
                        *common_flags(Path(cache, "unused"), Path(cache), steps), *flags,
                        *policy_flags(policy)], env)
                    for r in records:
                        timed = r["steps"][2:]
                        rows.append({"layout": name, "policy": policy, "repeat": repeat,
                                     "load1": load, "rank": r["rank"],
                                     "measured": r["measured"], "planned": r["planned"],
                                     "error": r["planned"] / r["measured"] - 1,
                                     "step_cpu_s": statistics.median(s["cpu_s"] for s in timed),
                                     "step_wall_s": statistics.median(s["wall_s"] for s in timed),
                                     "step_faults": statistics.median(s["faults"] for s in timed),
                                     "steps": r["steps"]})
                        with open(RESULTS / f"cpu_malloc_policy{tag}.jsonl", "a") as f:
                            f.write(json.dumps(rows[-1]) + "\n")  # kept if the run is cut
                        print(f"{name:11s} {policy:14s} rep {repeat} r{r['rank']} load "
                              f"{load:4.1f}  {r['measured'] / 2**20:6.1f}/"
                              f"{r['planned'] / 2**20:6.1f} MiB ({rows[-1]['error']:+.1%})  "
                              f"step cpu {rows[-1]['step_cpu_s']:.3f} s  faults "
                              f"{rows[-1]['step_faults'] / 1000:.1f}k", flush=True)
    (RESULTS / f"cpu_malloc_policy{tag}.json").write_text(json.dumps(rows, indent=1))
    (RESULTS / f"cpu_malloc_policy{tag}.txt").write_text(summary(rows))
    print(summary(rows))


def summary(rows: list[dict]) -> str:
    """Per layout and policy: the worst plan error over ranks and repeats, and the medians of
    step CPU time and faults (over ranks and repeats), with the load range seen."""
    lines = ["layout      policy          plan/measured-1 (worst, best)   step CPU s "
             "(median)  vs default  page faults/step  load1"]
    for name in dict.fromkeys(r["layout"] for r in rows):
        base = None
        for policy in dict.fromkeys(r["policy"] for r in rows):
            sel = [r for r in rows if r["layout"] == name and r["policy"] == policy]
            if not sel:
                continue
            errs = sorted((r["error"] for r in sel), key=abs)
            cpu = statistics.median(r["step_cpu_s"] for r in sel)
            base = cpu if policy == "default" else base
            rel = f"{cpu / base - 1:+6.1%}" if base else "   -  "
            loads = [r["load1"] for r in sel]
            lines.append(f"{name:11s} {policy:14s}  {errs[-1]:+6.1%} {errs[0]:+6.1%}"
                         f"                 {cpu:.3f}            {rel}     "
                         f"{statistics.median(r['step_faults'] for r in sel) / 1000:7.1f}k"
                         f"     {min(loads):.1f}-{max(loads):.1f}")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    if len(sys.argv) > 3 and sys.argv[1] == "--worker":
        worker(sys.argv[2], sys.argv[3], sys.argv[4:])
    else:
        main()
