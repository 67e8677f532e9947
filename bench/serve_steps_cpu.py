"""Continuous batching measured in decoding steps, which a busy machine does not distort:
the load of bench/serve_cpu.py (greedy requests, prompts of mixed lengths, max_tokens drawn
from 8..`--max-tokens`) sent by `--concurrency` closed-loop clients to the batching engine
in this process.

    python bench/serve_steps_cpu.py --requests 160 --output bench/results/serve_steps_cpu.json

Per request: the engine's step counter when it was submitted, when it joined the batch and
when it was answered. Reported: latency in steps (median, p95, max), steps waited before
joining (mean, max, how many requests waited at all), how often the batch started from empty
(`batches`), the steps run, mean slot occupancy, and wall time / tokens per second (these two
vary with the machine's load).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
for extra in (ROOT, ROOT / "bench"):
    if str(extra) not in sys.path:
        sys.path.insert(0, str(extra))

import torch  # noqa: E402
from serve_cpu import request_bodies  # noqa: E402
from synth_cpu import make_checkpoint  # noqa: E402


def _pct(xs: list[int], q: float) -> int:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def run(ckpt: Path, requests: int, concurrency: int, max_tokens: int,
        batch_size: int) -> dict[str, Any]:
    from scaletrain.inference import slot_decode
    from scaletrain.inference.batch_decode import Row
    from scaletrain.inference.generators import LocalGenerator
    from scaletrain.serving.engine import BatchingEngine

    gen = LocalGenerator.from_checkpoint(ckpt)
    rows = [Row(gen.encode(b["prompt"]), b["max_tokens"]) for b in
            request_bodies(requests, max_tokens)]
    engine = BatchingEngine(gen, batch_size, continuous=True)
    joined: dict[Any, int] = {}
    join = slot_decode.SlotBatch.try_join

    def try_join(self: Any, row: Any, sampling: Any, tag: Any) -> bool:
        ok = join(self, row, sampling, tag)
        if ok:
            joined[tag] = engine.steps
        return ok

    slot_decode.SlotBatch.try_join = try_join  # type: ignore[method-assign]
    engine.submit([rows[0]], (0.0, None, None))[0].result()  # warm-up
    start_batches, start_steps = engine.batches, engine.steps
    lat: list[int] = []
    wait: list[int] = []
    tokens = [0]
    lock = threading.Lock()
    todo = list(range(requests))

    def client() -> None:
        while True:
            with lock:
                if not todo:
                    return
                i = todo.pop()
            s0 = engine.steps
            fut = engine.submit([rows[i]], (0.0, None, None))[0]
            d = fut.result()
            with lock:
                lat.append(engine.steps - s0)
                wait.append(joined[fut] - s0)
                tokens[0] += len(d.ids)

    t0 = time.perf_counter()
    threads = [threading.Thread(target=client) for _ in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    m = engine.metrics()
    engine.close()
    slot_decode.SlotBatch.try_join = join  # type: ignore[method-assign]
    return {"latency_steps_median": statistics.median(lat),
            "latency_steps_p95": _pct(lat, 0.95), "latency_steps_max": max(lat),
            "wait_steps_mean": round(statistics.mean(wait), 2), "wait_steps_max": max(wait),
            "requests_that_waited": sum(w > 0 for w in wait),
            "batch_starts": engine.batches - start_batches, "steps": engine.steps - start_steps,
            "mean_slot_occupancy": m["mean_slot_occupancy"], "completion_tokens": tokens[0],
            "wall_s": round(wall, 2), "tokens_per_s": round(tokens[0] / wall, 1)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--requests", type=int, default=160)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--output", default=str(ROOT / "bench" / "results" / "serve_steps_cpu.json"))
    a = p.parse_args(argv)
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = make_checkpoint(Path(tmp) / "bench")
        runs = [run(ckpt, a.requests, a.concurrency, a.max_tokens, a.batch_size)
                for _ in range(a.repeats)]
    for k, r in enumerate(runs):
        print(f"run {k + 1}: " + ", ".join(f"{n} {v}" for n, v in r.items()))
    out = {"requests": a.requests, "concurrency": a.concurrency, "max_tokens": a.max_tokens,
           "batch_size": a.batch_size, "load_average_1min_at_end": round(os.getloadavg()[0], 2),
           "torch": torch.__version__, "runs": runs}
    Path(a.output).parent.mkdir(parents=True, exist_ok=True)
    Path(a.output).write_text(json.dumps(out, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
