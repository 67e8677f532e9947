"""Training throughput on one CUDA GPU: Llama-3.2-1B dimensions, bf16, seq 2048, compiled.

    python bench/train_gpu.py                     # search the largest micro-batch that fits
    python bench/train_gpu.py --batches 4,8 --ac partial
    python bench/train_gpu.py --fused-loss --fp8 rowwise   # chunked loss + FP8 (SM89+)

For each micro-batch size (1, 2, 4, 8, ... until one runs out of memory) a fresh `Trainer` is
built from a real Config and its `train_step` is timed on random token batches (random ids are
as good as text for throughput). Reports tokens/s, model FLOP utilization (MFU, from
scaletrain.plan.flops and the peak-FLOPS table) and peak memory per size, and writes JSON
(default bench/results/train_gpu.json). Without a CUDA device it prints a message and exits 0.
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import torch  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # run as `python bench/train_gpu.py` without an installed package
    sys.path.insert(0, str(ROOT))
RESULTS = ROOT / "bench" / "results" / "train_gpu.json"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="llama3.2-1b", help="model preset")
    p.add_argument("--vocab", type=int, default=None,
                   help="model vocabulary (default: the preset's, 128256 for Llama 3)")
    p.add_argument("--dim", type=int, default=None, help="override the preset's hidden size")
    p.add_argument("--layers", type=int, default=None, help="override the preset's depth")
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp32", "fp16"])
    p.add_argument("--ac", default="none", choices=["none", "partial", "full"],
                   help="activation checkpointing mode")
    p.add_argument("--no-compile", action="store_true", help="eager instead of torch.compile")
    p.add_argument("--batches", default=None,
                   help="comma-separated micro-batch sizes (default: 1, 2, 4, ... up to "
                        "--max-batch, stopping at the first that runs out of memory)")
    p.add_argument("--fused-loss", action="store_true",
                   help="training.fused_loss: chunked head + cross-entropy, no full logits")
    p.add_argument("--loss-chunk", type=int, default=4096, help="tokens per fused-loss chunk")
    p.add_argument("--fp8", default="none", choices=["none", "tensorwise", "rowwise"],
                   help="precision.fp8 (torchao float8; CUDA SM89+)")
    p.add_argument("--max-batch", type=int, default=64)
    p.add_argument("--steps", type=int, default=10, help="timed steps per size")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps first (compilation)")
    p.add_argument("--device", default="cuda", help="cuda, cuda:N (cpu only to test the script)")
    p.add_argument("--max-bytes", type=int, default=2_000_000,
                   help="corpus bytes read to construct the Trainer (its data is not used)")
    p.add_argument("--cache-dir", default=None, help="corpus cache (default: scaletrain's)")
    p.add_argument("--json", type=Path, default=RESULTS, help="where to write the results")
    p.add_argument("--verbose", action="store_true", help="show scaletrain's log messages")
    return p.parse_args(argv)


def build_trainer(a: argparse.Namespace, mbs: int, output: Path) -> Any:
    from scaletrain.config import load_config
    from scaletrain.models.args import get_preset
    from scaletrain.train.trainer import Trainer

    vocab = a.vocab or get_preset(a.model).vocab_size
    argv = [
        "--config", "llama3.2-1b" if a.model == "llama3.2-1b" else "debug",
        "--output", str(output), "--training.device", a.device,
        "--model.name", a.model, "--model.vocab_size", str(vocab),
        "--data.seq_len", str(a.seq_len), "--data.vocab_size", str(min(vocab, 8192)),
        "--data.max_bytes", str(a.max_bytes),
        "--training.micro_batch_size", str(mbs), "--training.grad_accum_steps", "1",
        "--training.sample_tokens", "0", "--training.eval_interval", "0",
        "--precision.dtype", a.dtype, "--activation_checkpoint.mode", a.ac,
        "--compile.enabled", "false" if a.no_compile else "true",
        "--lr_schedule.warmup_steps", "0", "--lr_schedule.decay", "constant",
        "--checkpoint.interval", "0",
        "--training.fused_loss", "true" if a.fused_loss else "false",
        "--training.loss_chunk_tokens", str(a.loss_chunk), "--precision.fp8", a.fp8,
        "--metrics.tensorboard", "false", "--metrics.progress_bar", "false",
    ]
    if a.dim:
        argv += ["--model.dim", str(a.dim)]
    if a.layers:
        argv += ["--model.n_layers", str(a.layers)]
    if a.cache_dir:
        argv += ["--data.cache_dir", str(a.cache_dir)]
    return Trainer(load_config(argv))


def is_oom(e: BaseException | None) -> bool:
    """An out-of-memory error, also when torch.compile or a kernel wraps or re-raises it."""
    seen = 0
    while e is not None and seen < 10:
        if isinstance(e, torch.cuda.OutOfMemoryError):
            return True
        if isinstance(e, RuntimeError) and "out of memory" in str(e).lower():
            return True
        e, seen = e.__cause__ or e.__context__, seen + 1
    return False


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure(a: argparse.Namespace, mbs: int, workdir: Path) -> dict[str, Any]:
    """Build, warm up and time one micro-batch size; raises on out-of-memory."""
    from scaletrain.plan.flops import flops_per_token
    from scaletrain.plan.hardware import device_name, peak_tflops

    t0 = time.perf_counter()
    trainer = build_trainer(a, mbs, workdir / f"mbs{mbs}")
    device = trainer.device
    vocab = trainer.model_args.vocab_size
    g = torch.Generator().manual_seed(mbs)
    batches = []
    for _ in range(2):
        w = torch.randint(0, vocab, (mbs, a.seq_len + 1), generator=g)
        batches.append((w[:, :-1].contiguous().to(device), w[:, 1:].contiguous().to(device)))
    build_s = time.perf_counter() - t0
    try:
        t0 = time.perf_counter()
        for i in range(a.warmup):
            trainer.train_step([batches[i % 2]])
        sync(device)
        warmup_s = time.perf_counter() - t0
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        times, losses = [], []
        for i in range(a.steps):
            t0 = time.perf_counter()
            loss, _ = trainer.train_step([batches[i % 2]])  # .item() inside synchronizes
            sync(device)
            times.append(time.perf_counter() - t0)
            losses.append(loss)
        fpt = flops_per_token(trainer.model_args, a.seq_len)
        peak = peak_tflops(device_name(device), trainer.dtype)
        tokens = mbs * a.seq_len
        tps = tokens / statistics.median(times)
        out: dict[str, Any] = {
            "micro_batch": mbs, "fits": True, "build_s": build_s, "warmup_s": warmup_s,
            "step_times_s": [round(t, 5) for t in times],
            "median_step_s": statistics.median(times), "tokens_per_s": tps,
            "tokens_per_s_mean": tokens * len(times) / sum(times),
            "flops_per_token": fpt, "tflops": fpt * tps / 1e12,
            "peak_tflops": peak, "mfu": None if peak is None else fpt * tps / (peak * 1e12),
            "last_loss": losses[-1],
        }
        if device.type == "cuda":
            out["peak_mem_allocated_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
            out["peak_mem_reserved_gib"] = torch.cuda.max_memory_reserved(device) / 2**30
        return out
    finally:
        del trainer, batches


def cleanup(device: torch.device) -> None:
    gc.collect()
    torch._dynamo.reset()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def environment(device: torch.device) -> dict[str, Any]:
    env: dict[str, Any] = {"torch": torch.__version__, "python": platform.python_version(),
                           "platform": platform.platform()}
    if device.type == "cuda":
        prop = torch.cuda.get_device_properties(device)
        env.update(gpu=prop.name, gpu_memory_gib=prop.total_memory / 2**30,
                   cuda=torch.version.cuda, gpu_count=torch.cuda.device_count())
    return env


def print_table(results: dict[str, Any]) -> None:
    rows = [[str(r["micro_batch"]), f"{r['tokens_per_s']:,.0f}",
             "n/a" if r["mfu"] is None else f"{100 * r['mfu']:.1f}%",
             f"{r.get('peak_mem_allocated_gib', float('nan')):.1f}"]
            if r["fits"] else [str(r["micro_batch"]), "OOM", "", ""]
            for r in results["runs"]]
    c = results["config"]
    title = (f"{c['model']} train step, {c['dtype']}, seq {c['seq_len']}, "
             f"{'eager' if c['no_compile'] else 'compiled'}, AC {c['ac']}")
    headers = ["micro-batch", "tokens/s", "MFU", "peak mem GiB"]
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        print(title)
        for row in [headers, *rows]:
            print("".join(f"{v:>14}" for v in row))
    else:
        table = Table(title=title)
        for h in headers:
            table.add_column(h, justify="right")
        for row in rows:
            table.add_row(*row)
        Console().print(table)
    best = results.get("largest_fitting")
    if best is not None:
        print(f"largest micro-batch that fits: {best}; best throughput at "
              f"{results['fastest']}")


def write_json(path: Path, data: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=1) + "\n")
    tmp.replace(path)


def main(argv: list[str] | None = None) -> dict[str, Any] | None:
    a = parse_args(argv)
    logging.basicConfig(level=logging.INFO if a.verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    device = torch.device(a.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("no CUDA device: skipped (bench/train_gpu.py needs a CUDA GPU)")
        return None
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    if a.batches:
        sizes, stop_at_oom = [int(s) for s in a.batches.split(",")], False
    else:
        sizes, stop_at_oom = [], True
        n = 1
        while n <= a.max_batch:
            sizes.append(n)
            n *= 2
    results: dict[str, Any] = {
        "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(a).items()},
        "environment": environment(device), "runs": [],
    }
    with tempfile.TemporaryDirectory(prefix="bench-train-gpu-") as tmp:
        for mbs in sizes:
            print(f"micro-batch {mbs} ...", file=sys.stderr, flush=True)
            try:
                r = measure(a, mbs, Path(tmp))
            except Exception as e:
                if not is_oom(e):
                    raise
                r = {"micro_batch": mbs, "fits": False, "error": str(e).splitlines()[0][:300]}
            cleanup(device)
            results["runs"].append(r)
            if r["fits"]:
                mfu = "n/a" if r["mfu"] is None else f"{100 * r['mfu']:.1f}%"
                print(f"  {r['tokens_per_s']:,.0f} tok/s, MFU {mfu}, peak "
                      f"{r.get('peak_mem_allocated_gib', 0):.1f} GiB", file=sys.stderr)
            else:
                print("  out of memory", file=sys.stderr)
                if stop_at_oom:
                    break
    fitting = [r for r in results["runs"] if r["fits"]]
    results["largest_fitting"] = max((r["micro_batch"] for r in fitting), default=None)
    results["fastest"] = (max(fitting, key=lambda r: r["tokens_per_s"])["micro_batch"]
                          if fitting else None)
    write_json(a.json, results)
    print_table(results)
    print(f"results written to {a.json}")
    return results


if __name__ == "__main__":
    main()
