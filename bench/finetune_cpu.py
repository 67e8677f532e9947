"""Fine-tuning methods side by side on CPU: full, freeze, LoRA r=8, LoRA r=16, QLoRA r=8.

    python bench/finetune_cpu.py                     # debug model and a ~100M model
    python bench/finetune_cpu.py --models debug --steps 5

For each model a random-init base (seeded; native checkpoint + a BPE tokenizer trained on the
bench's own SFT data) is fine-tuned by `scaletrain finetune`'s trainer on the same prompt/response
data (packed), seed, batch, learning rate and number of steps. Each (model, method) runs in its
own process, so the peak resident memory (ru_maxrss, which includes ~0.3-0.5 GiB of Python and
torch runtime) belongs to that run alone. Reported per run: trainable and total parameters, the
trainer's memory estimate per component (weights, gradients, AdamW state), the resident memory
once the model is built and its peak (QLoRA's peak includes loading the fp32 base before it is
quantized), tokens/s
(median and best over the steps after the first; padding included; on a shared machine
the best step is the better guide to uncontended speed) and the training loss after the last
step (the base is random, so this compares optimization progress, not adaptation quality).
Results are printed as one table and written as JSON (default bench/results/finetune_cpu.json).
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import os
import platform
import random
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
RESULTS = ROOT / "bench" / "results" / "finetune_cpu.json"

MODELS: dict[str, dict[str, int]] = {
    # the `debug` preset's dimensions
    "debug": dict(dim=256, n_layers=4, n_heads=8, n_kv_heads=4, ffn_dim=768, vocab_size=8192),
    # ~100M parameters (count printed in the table)
    "100m": dict(dim=768, n_layers=12, n_heads=12, n_kv_heads=4, ffn_dim=2304, vocab_size=8192),
    # llama3.2-1b's block dimensions (16 layers, dim 2048, GQA 32/8, SwiGLU 8192) with the
    # bench's small vocabulary: for the GPU table (`--device cuda --models 1b`)
    "1b": dict(dim=2048, n_layers=16, n_heads=32, n_kv_heads=8, ffn_dim=8192, vocab_size=8192),
    # for the smoke test
    "tiny": dict(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=128, vocab_size=512),
}
METHODS: dict[str, list[str]] = {
    "full": ["--finetune.method", "full"],
    "freeze": ["--finetune.method", "freeze", "--finetune.train_last", "1"],
    "lora-r8": ["--finetune.method", "lora", "--finetune.lora_rank", "8",
                "--finetune.lora_alpha", "16"],
    "lora-r16": ["--finetune.method", "lora", "--finetune.lora_rank", "16",
                 "--finetune.lora_alpha", "32"],
    "qlora-r8": ["--finetune.method", "qlora", "--finetune.lora_rank", "8",
                 "--finetune.lora_alpha", "16"],
}
WORDS = ["red", "green", "blue", "yellow", "black", "white", "the", "movie", "book", "was",
         "good", "bad", "is", "it", "what", "color", "a", "small", "large", "house"]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default="debug,100m", help=f"subset of {', '.join(MODELS)}")
    p.add_argument("--methods", default=",".join(METHODS), help=f"subset of {', '.join(METHODS)}")
    p.add_argument("--steps", type=int, default=12, help="optimizer steps per run")
    p.add_argument("--batch", type=int, default=4, help="sequences per step")
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--precision", default="auto", help="precision.dtype (auto: bf16 where fast)")
    p.add_argument("--device", default="cpu", help="cpu or cuda (cuda adds GPU peak memory)")
    p.add_argument("--work-dir", type=Path, default=None, help="bases and runs (default: temp)")
    p.add_argument("--json", type=Path, default=RESULTS, help="where to write the results")
    p.add_argument("--one", nargs=3, metavar=("BASE", "DATA", "METHOD"), help=argparse.SUPPRESS)
    p.add_argument("--output", type=Path, help=argparse.SUPPRESS)
    return p.parse_args(argv)


# --- inputs ------------------------------------------------------------------------------------
def write_data(path: Path, n: int = 400, seed: int = 0) -> Path:
    rng = random.Random(seed)
    lines = []
    for _ in range(n):
        words = " ".join(rng.choice(WORDS) for _ in range(rng.randint(8, 40)))
        color = rng.choice(WORDS[:6])
        lines.append(json.dumps({"prompt": f"{words}. the {color} one. what color? ",
                                 "response": f"it is {color}. " + " ".join(
                                     rng.choice(WORDS) for _ in range(rng.randint(4, 20)))}))
    path.write_text("\n".join(lines) + "\n")
    return path


def make_base(name: str, directory: Path, data: Path) -> Path:
    """A seeded random-init native checkpoint with a BPE tokenizer trained on the data."""
    if (directory / "meta.json").is_file():
        return directory
    from scaletrain.checkpoint.native_format import save_model_checkpoint
    from scaletrain.data.corpus import train_tokenizer
    from scaletrain.models.args import get_preset
    from scaletrain.models.transformer import build_model

    args = get_preset("debug").replace(**MODELS[name], max_seq_len=1024)
    texts = [r["prompt"] + r["response"] for r in map(json.loads, data.read_text().splitlines())]
    tok = train_tokenizer(texts, min(args.vocab_size, 2048))
    tok_file = directory.parent / f"{name}-tokenizer.json"
    tok.save(str(tok_file))
    save_model_checkpoint(build_model(args, seed=0), args, directory, tokenizer_file=tok_file)
    return directory


# --- one run (in its own process) ---------------------------------------------------------------
def current_rss_gib() -> float:
    """Resident memory now (Linux /proc; 0 elsewhere)."""
    try:
        pages = int(Path("/proc/self/statm").read_text().split()[1])
    except (OSError, IndexError, ValueError):
        return 0.0
    return pages * os.sysconf("SC_PAGE_SIZE") / 2**30


def run_one(a: argparse.Namespace) -> dict[str, Any]:
    from scaletrain.config import load_config
    from scaletrain.finetune.trainer import FinetuneTrainer

    base, data, method = a.one
    argv = ["--config", "finetune", "--output", str(a.output), "--finetune.base", base,
            "--finetune.data", data, "--finetune.task", "sft", "--training.device", a.device,
            "--training.steps", str(a.steps), "--training.micro_batch_size", str(a.batch),
            "--data.seq_len", str(a.seq_len), "--optimizer.lr", str(a.lr),
            "--lr_schedule.warmup_steps", "2", "--lr_schedule.decay", "constant",
            "--training.eval_interval", "0", "--training.eval_sequences", "4",
            "--checkpoint.save_final", "false", "--checkpoint.interval", "0",
            "--metrics.tensorboard", "false", "--metrics.progress_bar", "false",
            "--metrics.log_interval", "1000", "--precision.dtype", a.precision,
            *METHODS[method]]
    trainer = FinetuneTrainer(load_config(argv, prog="bench"))
    cuda = trainer.device.type == "cuda"
    if cuda:
        import torch

        built_gpu = torch.cuda.memory_allocated(trainer.device) / 2**30
        torch.cuda.reset_peak_memory_stats(trainer.device)
    gc.collect()
    built_rss = current_rss_gib()
    start = time.perf_counter()
    result = trainer.train()
    wall = time.perf_counter() - start
    rows = [json.loads(x) for x in (a.output / "metrics.jsonl").read_text().splitlines()]
    tps = [r["tokens_per_s"] for r in rows[1:]] or [rows[0]["tokens_per_s"]]
    return {
        "trainable_params": trainer.params.trainable, "total_params": trainer.params.total,
        "memory_estimate_bytes": trainer.memory,
        "peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
        "rss_after_build_gib": built_rss,
        "tokens_per_s": statistics.median(tps), "tokens_per_s_best": max(tps),
        "first_loss": result.losses[0],
        "final_loss": result.losses[-1], "val_loss": result.val_loss, "steps": result.steps,
        "wall_s": wall, "autocast": trainer.dtype,
        **({"gpu_allocated_after_build_gib": built_gpu,
            "gpu_peak_allocated_gib": torch.cuda.max_memory_allocated(trainer.device) / 2**30}
           if cuda else {}),
    }


# --- driver -------------------------------------------------------------------------------------
def table(rows: list[dict[str, Any]]) -> str:
    head = (f"{'model':<6} {'method':<9} {'trainable':>12} {'total':>12} {'%':>6} "
            f"{'est. MiB':>9} {'RSS built':>9} {'RSS peak':>8} {'tok/s':>7} {'best':>7} "
            f"{'loss 1st':>8} "
            f"{'loss last':>9}")
    lines = [head, "-" * len(head)]
    for r in rows:
        est = sum(r["memory_estimate_bytes"].values()) / 2**20
        lines.append(
            f"{r['model']:<6} {r['method']:<9} {r['trainable_params']:>12,} "
            f"{r['total_params']:>12,} {100 * r['trainable_params'] / r['total_params']:>6.2f} "
            f"{est:>9.1f} {r['rss_after_build_gib']:>9.2f} {r['peak_rss_gib']:>8.2f} "
            f"{r['tokens_per_s']:>7.0f} {r['tokens_per_s_best']:>7.0f} "
            f"{r['first_loss']:>8.3f} {r['final_loss']:>9.3f}"
            + (f" GPU peak {r['gpu_peak_allocated_gib']:.2f} GiB"
               if "gpu_peak_allocated_gib" in r else ""))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, Any] | None:
    a = parse_args(argv)
    if a.one:
        logging.basicConfig(level=logging.WARNING)
        print("RESULT " + json.dumps(run_one(a)))
        return None
    import torch

    work = a.work_dir or Path(tempfile.mkdtemp(prefix="finetune-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    data = write_data(work / "sft.jsonl")
    rows = []
    for model in a.models.split(","):
        base = make_base(model, work / f"base-{model}", data)
        for method in a.methods.split(","):
            out = work / f"run-{model}-{method}"
            cmd = [sys.executable, __file__, "--one", str(base), str(data), method, "--output",
                   str(out), "--steps", str(a.steps), "--batch", str(a.batch), "--seq-len",
                   str(a.seq_len), "--lr", str(a.lr), "--precision", a.precision,
                   "--device", a.device]
            proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
            line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT ")), None)
            if proc.returncode or line is None:
                raise RuntimeError(f"{model}/{method} failed:\n{proc.stderr[-3000:]}")
            rows.append({"model": model, "method": method, **json.loads(line[7:])})
            print(f"done {model} {method}: {rows[-1]['tokens_per_s']:.0f} tok/s", flush=True)
    print(table(rows))
    report = {
        "environment": {"torch": torch.__version__, "python": platform.python_version(),
                        "cpu_count": os.cpu_count(), "threads": torch.get_num_threads(),
                        "machine": platform.machine(),
                        "device": a.device,
                        "gpu": torch.cuda.get_device_name() if a.device.startswith("cuda")
                        else None},
        "settings": {"steps": a.steps, "batch": a.batch, "seq_len": a.seq_len, "lr": a.lr,
                     "precision": a.precision, "models": {m: MODELS[m] for m in
                                                          a.models.split(",")}},
        "runs": rows,
    }
    a.json.parent.mkdir(parents=True, exist_ok=True)
    a.json.write_text(json.dumps(report, indent=2) + "\n")
    return report


if __name__ == "__main__":
    main()
