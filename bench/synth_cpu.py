"""Synthetic-data generation throughput on CPU: batched vs one-at-a-time, HTTP vs in-process.

    python bench/synth_cpu.py                      # debug model, 32 prompts x 2 candidates
    python bench/synth_cpu.py --prompts 16 --max-new-tokens 32 --batch-sizes 1,8,16

The `debug` preset (random weights; no eos is ever met, so every candidate runs its full
`--max-new-tokens`) with a BPE tokenizer trained here. Prompts come from a template and topics
of different lengths, so batches are really left-padded. Sampling: temperature 0.8, top-p 0.95,
one seed per candidate. Rows:
  in-process bs=B : LocalGenerator.complete over all candidates, B prompts decoded together
  http            : `scaletrain serve` in a subprocess (server batch = the largest B) and the
                    HTTPGenerator client with `--concurrency` requests in flight
Torch runs `--threads` threads (default 1) in both processes. Every variant runs `--repeats`
times after one warm-up call; the median is reported. Results print as a table and go to
bench/results/synth_cpu.json. Timings on a shared machine vary.
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

os.environ.setdefault("HF_HUB_OFFLINE", "1")
ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from scaletrain.inference.generators import LocalGenerator, SamplingParams  # noqa: E402
from scaletrain.synth.http_client import HTTPGenerator  # noqa: E402
from scaletrain.synth.prompts import build_prompts  # noqa: E402

RESULTS = ROOT / "bench" / "results" / "synth_cpu.json"
TOPICS = ["rain", "the water cycle in mountain valleys", "tides",
          "how compilers turn source code into machine instructions", "bees",
          "the history of the printing press in Europe", "volcanoes", "prime numbers"]


def make_checkpoint(directory: Path) -> Path:
    import inspect as _inspect  # train the tokenizer on some of the standard library's source

    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    from scaletrain.checkpoint.native_format import save_model_checkpoint
    from scaletrain.models.args import get_preset
    from scaletrain.models.transformer import build_model

    text = [_inspect.getsource(m) for m in (argparse, json, subprocess, statistics)]
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel()
    tok.decoder = __import__("tokenizers").decoders.ByteLevel()
    tok.train_from_iterator(text, trainers.BpeTrainer(vocab_size=4000,
                                                      special_tokens=["<unk>", "<|eot|>"]))
    tok_path = directory.parent / "bench-tokenizer.json"
    tok.save(str(tok_path))
    args = get_preset("debug")
    model = build_model(args, seed=0)
    return save_model_checkpoint(model, args, directory, tokenizer_file=tok_path)


def timed(fn, repeats: int) -> tuple[float, Any]:
    fn()  # warm-up
    times, out = [], None
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), out


def start_server(ckpt: Path, batch: int, *extra: str) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "scaletrain", "serve", "--checkpoint", str(ckpt), "--port", "0",
         "--batch-size", str(batch), *extra], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
        text=True, cwd=ROOT)
    line = proc.stdout.readline()  # "serving NAME on http://HOST:PORT/v1 ..."
    if "http://" not in line:
        proc.kill()
        raise RuntimeError(f"scaletrain serve did not start: {line!r}")
    return proc, line.split(" on ")[1].split()[0]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--prompts", type=int, default=32)
    p.add_argument("--candidates", type=int, default=2)
    p.add_argument("--max-new-tokens", type=int, default=48)
    p.add_argument("--batch-sizes", default="1,8,32")
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--threads", type=int, default=1,
                   help="torch threads here and in the server (1: on a busy shared CPU, more "
                        "threads spin-wait on each other and run many times slower)")
    p.add_argument("--out", default=str(RESULTS))
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)
    os.environ["OMP_NUM_THREADS"] = str(a.threads)  # for the server subprocess
    sizes = [int(x) for x in a.batch_sizes.split(",")]
    tasks = build_prompts("Write a short paragraph about {topic}.", {"topic": TOPICS},
                          a.prompts, seed=0)
    flat = [t.prompt for t in tasks for _ in range(a.candidates)]
    seeds = list(range(len(flat)))
    params = SamplingParams(max_new_tokens=a.max_new_tokens, temperature=0.8, top_p=0.95)
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = make_checkpoint(Path(tmp) / "debug")
        for bs in sizes:
            gen = LocalGenerator.from_checkpoint(ckpt, batch_size=bs)
            sec, out = timed(lambda g=gen: g.complete(flat, params, seeds), a.repeats)
            rows.append({"variant": f"in-process bs={bs}", "seconds": sec,
                         "candidates": len(out), "tokens": sum(c.tokens for c in out)})
        proc, url = start_server(ckpt, max(sizes))  # inherits OMP_NUM_THREADS
        try:
            client = HTTPGenerator(url, concurrency=a.concurrency, timeout_s=600)
            sec, out = timed(lambda: client.complete(flat, params, seeds), a.repeats)
            rows.append({"variant": f"http (server bs={max(sizes)}, concurrency "
                                    f"{a.concurrency})", "seconds": sec,
                         "candidates": len(out), "tokens": sum(c.tokens for c in out)})
        finally:
            proc.terminate()
            proc.wait(timeout=30)
    base = rows[0]["tokens"] / rows[0]["seconds"]
    for r in rows:
        r["candidates_per_s"] = round(r["candidates"] / r["seconds"], 3)
        r["tokens_per_s"] = round(r["tokens"] / r["seconds"], 1)
        r["speedup_vs_first"] = round(r["tokens_per_s"] / base, 2)
        r["seconds"] = round(r["seconds"], 3)
    print(f"debug model, {a.prompts} prompts x {a.candidates} candidates, "
          f"{a.max_new_tokens} new tokens each, {torch.get_num_threads()} threads")
    print(f"{'variant':<40} {'s':>8} {'cand/s':>8} {'tok/s':>8} {'x':>6}")
    for r in rows:
        print(f"{r['variant']:<40} {r['seconds']:>8.2f} {r['candidates_per_s']:>8.2f} "
              f"{r['tokens_per_s']:>8.1f} {r['speedup_vs_first']:>6.2f}")
    result = {"args": vars(a), "rows": rows, "torch": torch.__version__,
              "machine": {"platform": platform.platform(), "cpus": os.cpu_count(),
                          "note": "shared machine (other jobs running); timings are noisy"},
              "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(result, indent=2))
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
