"""Data-path throughput on CPU: tokenization, loader against the training step, memory on 1 GB.

    python bench/data_cpu.py                  # 16 MB of stdlib text, GPT-NeoX tokenizer
    python bench/data_cpu.py --mbytes 4 --loader-batches 100 --steps 6

1. Tokenization: the same documents (standard-library sources as JSONL shards) tokenized by
   `tokenizers` directly (`encode_batch_fast` on in-memory texts: no reading, no writing) and
   by `scaletrain data tokenize`'s pipeline (read JSONL, encode, write .bin/.idx, merge) with 1
   and 2 workers. The ratio is our pipeline's overhead.
2. Loader: samples/s of the training loader (packed samples of seq_len 256, batch 8, shuffled
   global order) with 0 and 2 workers, against the debug model's training step rate measured
   by the real Trainer (`scaletrain train` defaults, a few steps): loader/step ratio and the
   trainer's own `data_wait_s` share of step time.
3. Memory: a subprocess reads every sample of a 1 GB indexed dataset (a sparse file) through
   the loader; peak RSS (which counts the file pages of the memory map) and peak anonymous RSS
   (the process's own memory, i.e. what a copy of the corpus would raise).

Prints a table and writes JSON (default bench/results/data_cpu.json).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import statistics
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
RESULTS = ROOT / "bench" / "results" / "data_cpu.json"
NEOX = next((p for p in (ROOT.parent / "shared/fixtures/data/gpt-neox-tokenizer.json",
                         Path("/work/shared/fixtures/data/gpt-neox-tokenizer.json"))
             if p.is_file()), None)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mbytes", type=float, default=16, help="MB of text to tokenize")
    p.add_argument("--shards", type=int, default=4)
    p.add_argument("--tokenizer", default=str(NEOX) if NEOX else None,
                   help="tokenizer.json (default: the GPT-NeoX fixture)")
    p.add_argument("--loader-batches", type=int, default=400)
    p.add_argument("--steps", type=int, default=12, help="trainer steps for the step rate")
    p.add_argument("--skip-memory", action="store_true")
    p.add_argument("--output", default=str(RESULTS))
    return p.parse_args(argv)


def stdlib_texts(max_bytes: int) -> list[str]:
    root = Path(sysconfig.get_paths()["stdlib"])
    out, total = [], 0
    for f in sorted(root.rglob("*.py")):
        if "site-packages" in f.parts:
            continue
        text = f.read_bytes().decode("utf-8", "replace")
        if text.strip():
            out.append(text)
            total += len(text.encode())
        if total >= max_bytes:
            break
    return out


def bench_tokenize(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    from tokenizers import Tokenizer

    from scaletrain.data.tokenize import tokenize_to_indexed

    texts = stdlib_texts(int(args.mbytes * 1e6))
    shard_dir = work / "docs"
    shard_dir.mkdir()
    per = -(-len(texts) // args.shards)
    for s in range(args.shards):
        with open(shard_dir / f"s{s:03d}.jsonl", "w") as f:
            for t in texts[s * per:(s + 1) * per]:
                f.write(json.dumps({"text": t}) + "\n")
    tok = Tokenizer.from_file(args.tokenizer)
    t0 = time.perf_counter()
    n_direct = 0
    for i in range(0, len(texts), 256):
        n_direct += sum(len(e.ids) for e in tok.encode_batch_fast(texts[i:i + 256],
                                                                  add_special_tokens=False))
    direct_s = time.perf_counter() - t0
    row: dict[str, Any] = {"documents": len(texts), "mbytes": sum(map(len, texts)) / 1e6,
                           "direct_tokens": n_direct, "direct_s": direct_s,
                           "direct_tokens_per_s": n_direct / direct_s}
    shards = sorted(shard_dir.iterdir())
    for w in (1, 2):
        st = tokenize_to_indexed(shards, work / f"out{w}", args.tokenizer, workers=w)
        row[f"ours_w{w}_s"] = st.seconds
        row[f"ours_w{w}_tokens_per_s"] = st.tokens_per_s
        row["ours_tokens"] = st.tokens  # = direct + one EOS per document
        row["tokens_per_document"] = st.tokens_per_document
    row["overhead_w1"] = row["ours_w1_s"] / direct_s
    return row


def bench_loader(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    from scaletrain.config import load_config
    from scaletrain.data.loader import BatchStream, Windows
    from scaletrain.data.sources import build_sources
    from scaletrain.train.trainer import Trainer

    cfg = load_config(["--output", str(work / "run"), "--training.steps", str(args.steps),
                       "--training.eval_interval", "0", "--training.sample_tokens", "0",
                       "--checkpoint.interval", "0", "--checkpoint.save_final", "false",
                       "--metrics.tensorboard", "false", "--metrics.progress_bar", "false",
                       "--training.eval_sequences", "4"])
    n = args.loader_batches * cfg.training.micro_batch_size
    train, _, _ = build_sources(cfg.data, cfg.training.seed, n)
    row: dict[str, Any] = {"seq_len": cfg.data.seq_len, "batch": cfg.training.micro_batch_size}
    for workers in (0, 2):
        stream = BatchStream(Windows(train), cfg.training.micro_batch_size,
                             num_workers=workers, persistent_workers=False)
        next(stream)  # worker start-up is not throughput
        t0 = time.perf_counter()
        for _ in range(args.loader_batches - 1):
            next(stream)
        dt = time.perf_counter() - t0
        row[f"loader_w{workers}_samples_per_s"] = (args.loader_batches - 1) * stream.batch_size / dt
    trainer = Trainer(cfg)
    trainer.train()
    rows = [json.loads(x) for x in (work / "run/metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "step_time_s" in r][2:]  # skip warm-up
    step_s = statistics.median(r["step_time_s"] for r in steps)
    row["step_s"] = step_s
    row["step_samples_per_s"] = cfg.training.micro_batch_size * trainer.ga / step_s
    row["loader_over_step"] = row["loader_w0_samples_per_s"] / row["step_samples_per_s"]
    row["data_wait_share"] = sum(r["data_wait_s"] for r in steps) / sum(
        r["step_time_s"] for r in steps)
    return row


MEMORY_CHILD = r"""
import json, resource, sys, time
from scaletrain.data.gpt_dataset import GPTDataset
from scaletrain.data.indexed import IndexedDataset
from scaletrain.data.loader import BatchStream, Windows
def anon():
    for line in open("/proc/self/status"):
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) / 1024
src = GPTDataset(IndexedDataset(sys.argv[1]), 2048, seed=0)
stream = BatchStream(Windows(src), 32)
peak_anon, t0, n = anon(), time.perf_counter(), 0
while stream.batches_left:
    next(stream); n += 32
    if n % 8192 == 0:
        peak_anon = max(peak_anon, anon())
print(json.dumps({"samples": n, "seconds": time.perf_counter() - t0,
                  "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                  "peak_anon_mb": max(peak_anon, anon())}))
"""


def bench_memory(work: Path) -> dict[str, Any]:
    import numpy as np

    prefix = work / "big"
    gib, doc = 1 << 30, 4096
    with open(f"{prefix}.bin", "wb") as f:
        f.truncate(gib)
    n = gib // 2 // doc
    with open(f"{prefix}.idx", "wb") as f:
        f.write(b"MMIDIDX\x00\x00" + np.array([1], "<u8").tobytes() + bytes([8])
                + np.array([n, n + 1], "<u8").tobytes())
        f.write(np.full(n, doc, "<i4").tobytes() + (np.arange(n, dtype="<i8") * doc * 2).tobytes()
                + np.arange(n + 1, dtype="<i8").tobytes())
    out = subprocess.run([sys.executable, "-c", MEMORY_CHILD, str(prefix)], check=True,
                         capture_output=True, text=True, env={**os.environ,
                                                              "PYTHONPATH": str(ROOT)})
    return {"dataset_gib": 1.0, **json.loads(out.stdout.strip().splitlines()[-1])}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    if not args.tokenizer:
        print("no tokenizer: pass --tokenizer tokenizer.json", file=sys.stderr)
        return 2
    result: dict[str, Any] = {"machine": platform.platform(), "cpus": os.cpu_count(),
                              "note": "shared machine: other jobs ran at the same time"}
    with tempfile.TemporaryDirectory(prefix="data-bench-") as tmp:
        work = Path(tmp)
        result["tokenize"] = tok = bench_tokenize(args, work)
        print(f"tokenize {tok['mbytes']:.1f} MB, {tok['documents']} docs: tokenizers direct "
              f"{tok['direct_tokens_per_s']:,.0f} tok/s | ours 1 worker "
              f"{tok['ours_w1_tokens_per_s']:,.0f} tok/s ({tok['overhead_w1']:.2f}x the direct "
              f"time) | 2 workers {tok['ours_w2_tokens_per_s']:,.0f} tok/s | "
              f"{tok['tokens_per_document']:.0f} tokens/doc")
        result["loader"] = ld = bench_loader(args, work)
        print(f"loader (seq {ld['seq_len']}, batch {ld['batch']}): "
              f"{ld['loader_w0_samples_per_s']:,.0f} samples/s (0 workers), "
              f"{ld['loader_w2_samples_per_s']:,.0f} (2 workers) | debug-model step "
              f"{ld['step_s'] * 1e3:.0f} ms = {ld['step_samples_per_s']:.1f} samples/s | "
              f"loader/step {ld['loader_over_step']:,.0f}x | data_wait "
              f"{100 * ld['data_wait_share']:.3f}% of step time")
        if not args.skip_memory:
            result["memory"] = mem = bench_memory(work)
            print(f"1 GiB dataset, every sample read ({mem['samples']:,} in "
                  f"{mem['seconds']:.1f}s): peak RSS {mem['peak_rss_mb']:.0f} MB (incl. mapped "
                  f"file pages), peak anonymous RSS {mem['peak_anon_mb']:.0f} MB")
    out = Path(args.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
