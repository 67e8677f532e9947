"""Chunked (fused) linear + cross-entropy against the plain head + loss on CPU: peak memory
and tokens/s of forward + backward at a large vocabulary.

    python bench/loss_cpu.py                       # 128k vocab, dim 256, 4096 tokens, fp32

Each variant runs in its own subprocess, so ru_maxrss (peak resident memory) is that variant's
alone; the figure reported is the peak above the process's resident memory before the loss
(inputs allocated). Raw output: bench/results/loss_cpu.json.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

import torch

RESULTS = Path(__file__).parent / "results" / "loss_cpu.json"


def _rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def run_one(variant: str, tokens: int, dim: int, vocab: int, chunk: int, reps: int) -> dict:
    from scaletrain.train.chunked_loss import chunked_linear_cross_entropy
    from scaletrain.train.loss import cross_entropy_sum

    torch.manual_seed(0)
    h = torch.randn(tokens, dim, requires_grad=True)
    w = (torch.randn(vocab, dim) * 0.02).requires_grad_()
    y = torch.randint(0, vocab, (tokens,))
    before = _rss_mib()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        if variant == "plain":
            loss = cross_entropy_sum(h @ w.t(), y)
        else:
            loss = chunked_linear_cross_entropy(h, w, y, chunk=chunk)
        loss.backward()
        times.append(time.perf_counter() - t0)
        h.grad = w.grad = None
    best = min(times)
    return {"variant": variant, "tokens": tokens, "dim": dim, "vocab": vocab,
            "chunk": chunk if variant == "chunked" else None, "loss": float(loss),
            "best_s": best, "tokens_per_s": tokens / best,
            "peak_rss_above_inputs_mib": _rss_mib() - before,
            "logits_fp32_mib": tokens * vocab * 4 / 2**20, "torch_threads": torch.get_num_threads()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--vocab", type=int, default=128_256)
    p.add_argument("--chunk", type=int, default=1024)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--one", choices=["plain", "chunked"], help=argparse.SUPPRESS)
    p.add_argument("--json", type=Path, default=RESULTS)
    a = p.parse_args()
    if a.one:
        print(json.dumps(run_one(a.one, a.tokens, a.dim, a.vocab, a.chunk, a.reps)))
        return
    rows = []
    for variant in ("plain", "chunked"):
        out = subprocess.run([sys.executable, __file__, "--one", variant, "--tokens", str(a.tokens),
                              "--dim", str(a.dim), "--vocab", str(a.vocab), "--chunk",
                              str(a.chunk), "--reps", str(a.reps)],
                             capture_output=True, text=True, check=True)
        rows.append(json.loads(out.stdout))
        print(json.dumps(rows[-1]))
    a.json.parent.mkdir(parents=True, exist_ok=True)
    a.json.write_text(json.dumps({"command": " ".join(sys.argv), "results": rows}, indent=1))


if __name__ == "__main__":
    main()
