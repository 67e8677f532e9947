"""Estimate vs measurement on CPU: saved activation bytes and peak RSS of one training step.

    python bench/plan_cpu.py            # prints two tables, writes bench/results/plan_cpu.json

1. Saved activation bytes: `saved_tensors_hooks` count (unique storages, parameters and their
   autocast copies left out) against `activation_bytes(...).autograd_saved`, for several shapes,
   dtypes and every recompute mode.
2. Peak RSS delta: a fresh process builds the model and optimizer (baseline RSS), then runs one
   forward/backward/AdamW step; the highest RSS sampled every millisecond during the step minus
   the baseline, against the estimate of what the step adds: the planner's sum (gradients +
   optimizer state + activations + loss buffers + autocast copies, an upper bound) and the
   larger of its two phases (forward/backward: activations + loss buffers + autocast copies;
   optimizer step: gradients + optimizer state).
   glibc's allocator and PyTorch's CPU caching make RSS a coarse measure; treat it as such.
"""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
import time
from pathlib import Path

RESULTS = Path(__file__).parent / "results"

SHAPES = {
    "debug": dict(dim=256, n_layers=4, n_heads=8, n_kv_heads=4, vocab_size=8192, ffn_dim=768,
                  max_seq_len=1024),
    "wide": dict(dim=512, n_layers=2, n_heads=8, n_kv_heads=2, vocab_size=4096, ffn_dim=1408,
                 max_seq_len=1024),
}
RSS_CASES = [
    ("debug", 8, 256, "fp32", "none"),
    ("debug", 8, 256, "fp32", "full"),
    ("debug", 4, 512, "bf16", "none"),
    ("wide", 4, 512, "fp32", "partial"),
]


def saved_bytes_table() -> list[dict]:
    from scaletrain.config import ActivationCheckpointConfig as AC
    from scaletrain.models.args import ModelArgs
    from scaletrain.plan.memory.activations import ActivationSpec, activation_bytes
    from scaletrain.train.saved_bytes import measure_saved_bytes

    rows = []
    modes = [AC(), AC(mode="full"), AC(mode="partial", every=2),
             AC(mode="partial", every=1, scope="attention")]
    for (name, shape), (mbs, seq), (dt, pd), ac in itertools.product(
            SHAPES.items(), [(2, 128), (4, 256)], [("fp32", "fp32"), ("bf16", "fp32"),
                                                   ("bf16", "bf16")], modes):
        args = ModelArgs(**shape)
        measured = measure_saved_bytes(args, mbs, seq, dt, pd, ac).activations
        spec = ActivationSpec(mbs=mbs, seq_len=seq, compute_dtype=dt, residual_dtype=pd,
                              recompute=ac.mode, every=ac.every, scope=ac.scope, kernels="cpu")
        est = activation_bytes(args, spec).autograd_saved
        mode = ac.mode if ac.mode != "partial" else f"sel/{ac.scope}/{ac.every}"
        rows.append({"model": name, "mbs": mbs, "seq": seq, "dtype": dt, "param_dtype": pd,
                     "recompute": mode, "measured": measured, "estimate": est,
                     "error": est / measured - 1})
    return rows


def _current_rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _rss_child(name: str, mbs: int, seq: int, dtype: str, recompute: str) -> dict:
    import threading

    import torch

    from scaletrain.config import ActivationCheckpointConfig, OptimizerConfig
    from scaletrain.models.args import ModelArgs
    from scaletrain.models.transformer import build_model
    from scaletrain.parallel.activation_checkpoint import apply_ac
    from scaletrain.parallel.dims import ParallelDims
    from scaletrain.plan.estimate import estimate
    from scaletrain.plan.layout import Layout
    from scaletrain.train.loss import cross_entropy_sum
    from scaletrain.train.optim import build_optimizer

    torch.set_num_threads(2)
    args = ModelArgs(**SHAPES[name])
    model = build_model(args, seed=0)
    apply_ac(model, ActivationCheckpointConfig(mode=recompute, every=2))
    opt = build_optimizer(model, OptimizerConfig(), torch.device("cpu"), "fp32")
    tokens = torch.randint(0, args.vocab_size, (mbs, seq + 1))
    base = _current_rss()
    peak = [base]
    done = threading.Event()

    def sample() -> None:  # current RSS every millisecond: the high-water mark of this step
        while not done.is_set():
            peak[0] = max(peak[0], _current_rss())
            time.sleep(0.001)

    sampler = threading.Thread(target=sample)
    sampler.start()
    t0 = time.perf_counter()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == "bf16"):
        logits = model(tokens[:, :-1])
    loss = cross_entropy_sum(logits, tokens[:, 1:])
    loss.backward()
    opt.step()
    done.set()
    sampler.join()
    lay = Layout(dims=ParallelDims(), mbs=mbs, seq_len=seq, precision=dtype, param_dtype="fp32",
                 recompute=recompute, every=2, kernels="cpu")
    mem = estimate(args, lay).memory_bytes
    added = sum(mem[k] for k in ("gradients", "optimizer", "activations", "logits_loss",
                                 "cast_weights"))
    # The first step never holds all of it at once: activations die as gradients are born, and
    # AdamW's state appears at the step, after backward.
    phases = max(mem["activations"] + mem["logits_loss"] + mem["cast_weights"],
                 mem["gradients"] + mem["optimizer"])
    return {"model": name, "mbs": mbs, "seq": seq, "dtype": dtype, "recompute": recompute,
            "rss_delta": peak[0] - base, "estimate": added, "estimate_phases": phases,
            "step_s": time.perf_counter() - t0}


def rss_table() -> list[dict]:
    rows = []
    for case in RSS_CASES:
        out = subprocess.run([sys.executable, __file__, "--child", *map(str, case)],
                             capture_output=True, text=True, check=True)
        row = json.loads(out.stdout.strip().splitlines()[-1])
        row["error"] = row["estimate"] / row["rss_delta"] - 1
        row["error_phases"] = row["estimate_phases"] / row["rss_delta"] - 1
        rows.append(row)
    return rows


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        name, mbs, seq, dtype, recompute = sys.argv[2:7]
        print(json.dumps(_rss_child(name, int(mbs), int(seq), dtype, recompute)))
        return
    saved = saved_bytes_table()
    print(f"{'model':<6} {'mbs':>3} {'seq':>4} {'dtype':<5} {'params':<6} {'recompute':<18} "
          f"{'measured B':>12} {'estimate B':>12} {'error':>8}")
    for r in saved:
        print(f"{r['model']:<6} {r['mbs']:>3} {r['seq']:>4} {r['dtype']:<5} "
              f"{r['param_dtype']:<6} {r['recompute']:<18} {r['measured']:>12,} "
              f"{r['estimate']:>12,} {r['error']:>+8.3%}")
    rss = rss_table()
    print(f"\n{'model':<6} {'mbs':>3} {'seq':>4} {'dtype':<5} {'recompute':<10} "
          f"{'RSS delta MiB':>14} {'sum MiB':>9} {'error':>8} {'phases MiB':>11} {'error':>8}")
    for r in rss:
        print(f"{r['model']:<6} {r['mbs']:>3} {r['seq']:>4} {r['dtype']:<5} "
              f"{r['recompute']:<10} {r['rss_delta'] / 2**20:>14.1f} "
              f"{r['estimate'] / 2**20:>9.1f} {r['error']:>+8.1%} "
              f"{r['estimate_phases'] / 2**20:>11.1f} {r['error_phases']:>+8.1%}")
    RESULTS.mkdir(exist_ok=True)
    tmp = RESULTS / "plan_cpu.json.tmp"
    tmp.write_text(json.dumps({"saved_bytes": saved, "peak_rss": rss,
                               "host": {"cpus": os.cpu_count(), "shared": True}}, indent=2))
    tmp.rename(RESULTS / "plan_cpu.json")


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    main()
