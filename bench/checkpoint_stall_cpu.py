"""How long a checkpoint save stalls training, synchronous vs background (`checkpoint.async_save`),
on this machine's CPU and disk.

    python bench/checkpoint_stall_cpu.py [--models debug,llama3.2-1b] [--out DIR]

For each model: the model is built (fp32) with its optimizer state (AdamW, one step taken; for
models whose state and a staged copy would not fit in host memory, `--weights-only` models use
plain SGD, which keeps no state), then saved three times each way through the trainer's
`Checkpointer`:
- synchronous: the call takes the whole write (hashes, manifest and rename included);
- background: the call returns once the state is copied to host memory (the stall); `wait()`
  then gives the time until the checkpoint is complete. The first background save allocates
  the staging area, later ones reuse it.
Prints one JSON line per model; the figures are medians of the three saves (the first
background save separately).
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch

from scaletrain.models.args import PRESETS
from scaletrain.models.transformer import build_model
from scaletrain.train.checkpoint import Checkpointer

REPEATS = 3


def measure(name: str, folder: Path, weights_only: bool) -> dict[str, object]:
    args = PRESETS[name]
    model = build_model(args, torch.device("cpu"), seed=0)
    params = list(model.parameters())
    if weights_only:
        optimizer: torch.optim.Optimizer = torch.optim.SGD(params, lr=0.0)
    else:
        optimizer = torch.optim.AdamW(params, lr=1e-4)
        for p in params:
            p.grad = torch.zeros_like(p)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    extra = {"step": 0}
    sync_s, stall_s, total_s = [], [], []
    sync = Checkpointer(folder / "sync", 1, args)
    for step in range(1, REPEATS + 1):
        t0 = time.perf_counter()
        path = sync.save(step, model, optimizer, extra)
        sync_s.append(time.perf_counter() - t0)
    nbytes = sum(f.stat().st_size for f in path.iterdir())
    shutil.rmtree(folder / "sync")
    background = Checkpointer(folder / "async", 1, args, async_save=True)
    for step in range(1, REPEATS + 2):
        t0 = time.perf_counter()
        background.save(step, model, optimizer, extra)
        stall = time.perf_counter() - t0
        background.wait()
        stall_s.append(stall)
        total_s.append(time.perf_counter() - t0)
    background.close()
    shutil.rmtree(folder / "async")
    return {
        "model": name, "parameters": sum(p.numel() for p in params),
        "optimizer": "SGD (no state)" if weights_only else "AdamW",
        "checkpoint_gb": round(nbytes / 1e9, 3),
        "sync_save_s": round(statistics.median(sync_s), 3),
        "async_first_stall_s": round(stall_s[0], 3),
        "async_stall_s": round(statistics.median(stall_s[1:]), 3),
        "async_complete_s": round(statistics.median(total_s[1:]), 3),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default="debug,qwen2.5-0.5b")
    p.add_argument("--weights-only", default="",
                   help="comma-separated models saved without optimizer state (SGD)")
    p.add_argument("--out", default=None, help="folder for the checkpoints (default: a temp dir)")
    a = p.parse_args()
    torch.set_num_threads(2)
    root = Path(a.out) if a.out else Path(tempfile.mkdtemp(prefix="ckpt-stall-"))
    weights_only = set(filter(None, a.weights_only.split(",")))
    try:
        for name in filter(None, a.models.split(",")):
            print(json.dumps(measure(name, root / name, name in weights_only)), flush=True)
    finally:
        if not a.out:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
