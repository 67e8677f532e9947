"""The planner's memory estimate against `torch.cuda.max_memory_allocated()` on one GPU.

    python bench/plan_gpu.py                      # debug and llama3.2-1b, every recompute mode

For each model, recompute mode, micro-batch and sequence length a real `Trainer` is built (bf16
autocast over fp32 parameters, AdamW, eager), three steps are run on random tokens, and the peak
allocated memory is compared with `scaletrain.plan.from_config.estimate_for_config` of the same
config: its `peak` (what decides a fit) and its `total` (every component at once). Writes
bench/results/plan_gpu.json.
Without CUDA it prints a message and exits 0.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from train_gpu import ROOT, build_trainer, cleanup, environment, is_oom, sync  # noqa: E402

RESULTS = ROOT / "bench" / "results" / "plan_gpu.json"
GRID = {  # model -> [(micro-batch, seq_len)]
    "debug": [(8, 512), (32, 512)],
    "llama3.2-1b": [(1, 1024), (4, 1024), (2, 2048)],
}


def one(model: str, ac: str, mbs: int, seq: int, work: Path) -> dict[str, Any]:
    from scaletrain.plan.from_config import estimate_for_config

    a = argparse.Namespace(model=model, vocab=None, dim=None, layers=None, seq_len=seq,
                           dtype="bf16", ac=ac, no_compile=True, device="cuda",
                           max_bytes=2_000_000, cache_dir=str(work / "cache"))
    trainer = build_trainer(a, mbs, work / f"{model}-{ac}-{mbs}-{seq}")
    est = estimate_for_config(trainer.cfg)
    device = trainer.device
    vocab = trainer.model_args.vocab_size
    w = torch.randint(0, vocab, (mbs, seq + 1))
    batch = (w[:, :-1].contiguous().to(device), w[:, 1:].contiguous().to(device))
    torch.cuda.reset_peak_memory_stats(device)
    for _ in range(3):
        trainer.train_step([batch])
    sync(device)
    peak = torch.cuda.max_memory_allocated(device)
    mem = est["memory_bytes"]
    del trainer, batch
    return {"model": model, "recompute": ac, "mbs": mbs, "seq": seq, "measured_bytes": peak,
            "estimate_peak_bytes": mem["peak"], "error": (mem["peak"] - peak) / peak,
            "estimate_total_bytes": mem["total"],
            "error_total": (mem["total"] - peak) / peak, "estimate_components": mem}


def main() -> int:
    if not torch.cuda.is_available():
        print("no CUDA device: nothing to measure")
        return 0
    import tempfile

    work = Path(tempfile.mkdtemp(prefix="plan-gpu-"))
    rows = []
    for model, shapes in GRID.items():
        for ac in ("none", "partial", "full"):
            for mbs, seq in shapes:
                try:
                    r = one(model, ac, mbs, seq, work)
                except Exception as e:  # noqa: BLE001 - an OOM row is a result too
                    if not is_oom(e):
                        raise
                    r = {"model": model, "recompute": ac, "mbs": mbs, "seq": seq, "oom": True}
                cleanup(torch.device("cuda"))
                rows.append(r)
                if "error" in r:
                    print(f"{model:12s} {ac:9s} mbs {mbs:3d} seq {seq:5d}: measured "
                          f"{r['measured_bytes'] / 2**30:7.2f} GiB, peak estimate "
                          f"{r['estimate_peak_bytes'] / 2**30:7.2f} GiB ({100 * r['error']:+.1f}%),"
                          f" sum of components {100 * r['error_total']:+.1f}%",
                          flush=True)
                else:
                    print(f"{model:12s} {ac:9s} mbs {mbs:3d} seq {seq:5d}: OOM", flush=True)
    out = {"environment": environment(torch.device("cuda")), "rows": rows}
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {RESULTS}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
