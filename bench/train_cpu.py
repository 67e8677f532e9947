"""Training throughput on CPU: scaletrain's `Trainer.train_step` against a plain PyTorch loop
over transformers' `LlamaForCausalLM` with the same dimensions, weights, batch and optimizer.

    python bench/train_cpu.py                       # 17M Llama, batch 8 x 256, all four variants
    python bench/train_cpu.py --steps 4 --skip-compile

Variants: fp32 eager, bf16 eager (autocast; only on CPUs with AVX-512 bf16), fp32 compiled,
bf16 compiled. Only the optimizer step itself is timed (forward, loss, backward, clipping,
AdamW step, zero_grad); warmup steps (which also compile) are excluded. The two sides run in
ABBA order step by step, so drifts in machine load hit both alike. Results are printed as a
table and written as JSON (default bench/results/train_cpu.json).
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
from collections.abc import Callable
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # run as `python bench/train_cpu.py` without an installed package
    sys.path.insert(0, str(ROOT))
RESULTS = ROOT / "bench" / "results" / "train_cpu.json"
VARIANTS = ("fp32-eager", "bf16-eager", "fp32-compiled", "bf16-compiled")
Batch = tuple[torch.Tensor, torch.Tensor]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=10, help="timed steps per side and variant")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps first (compilation)")
    p.add_argument("--batch", type=int, default=8, help="sequences per step")
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--dim", type=int, default=384)
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--heads", type=int, default=6)
    p.add_argument("--kv-heads", type=int, default=2, help="key/value heads (GQA when < heads)")
    p.add_argument("--ffn-dim", type=int, default=1024)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--threads", type=int, default=None,
                   help="torch.set_num_threads for both sides (default: torch's default)")
    p.add_argument("--variants", default=",".join(VARIANTS),
                   help=f"comma-separated subset of {', '.join(VARIANTS)}")
    p.add_argument("--skip-compile", action="store_true", help="only the eager variants")
    p.add_argument("--cache-dir", default=None,
                   help="corpus cache for building the Trainer (default: scaletrain's cache)")
    p.add_argument("--max-bytes", type=int, default=None,
                   help="corpus bytes for building the Trainer (None: the whole default corpus)")
    p.add_argument("--json", type=Path, default=RESULTS, help="where to write the results")
    p.add_argument("--verbose", action="store_true", help="show scaletrain's log messages")
    return p.parse_args(argv)


# --- the two sides ------------------------------------------------------------------------------
def build_ours(a: argparse.Namespace, dtype: str, compiled: bool, output: Path) -> Any:
    """A real Trainer from a real Config; its data is built (from the cache) but not used."""
    from scaletrain.config import load_config
    from scaletrain.train.trainer import Trainer

    argv = [
        "--output", str(output), "--training.device", "cpu",
        "--model.name", getattr(a, "model_name", "debug"),
        "--model.dim", str(a.dim), "--model.n_layers", str(a.layers),
        "--model.n_heads", str(a.heads), "--model.n_kv_heads", str(a.kv_heads),
        "--model.ffn_dim", str(a.ffn_dim), "--model.vocab_size", str(a.vocab),
        "--model.max_seq_len", str(max(a.seq_len, 1024)),
        "--data.seq_len", str(a.seq_len), "--data.vocab_size", str(min(a.vocab, 8192)),
        "--training.micro_batch_size", str(a.batch), "--training.grad_accum_steps", "1",
        "--training.sample_tokens", "0", "--precision.dtype", dtype,
        "--compile.enabled", str(compiled).lower(),
        "--lr_schedule.warmup_steps", "0", "--lr_schedule.decay", "constant",
        "--metrics.tensorboard", "false", "--metrics.progress_bar", "false",
    ]
    if a.cache_dir:
        argv += ["--data.cache_dir", str(a.cache_dir)]
    if a.max_bytes:
        argv += ["--data.max_bytes", str(a.max_bytes)]
    return Trainer(load_config(argv))


def build_baseline(trainer: Any, compiled: bool) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """transformers' model of the Trainer's family (LlamaForCausalLM, Qwen2ForCausalLM, ...) with
    its dimensions and (copied) initial weights, and an AdamW with the Trainer's
    hyper-parameters, weight-decay groups and kernel flags. SDPA attention, except where the
    model soft-caps attention logits (Gemma 2), which transformers computes eagerly."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from scaletrain.models.hf import hf_config_from_model_args
    from scaletrain.models.hf_state_dict import to_hf_state_dict

    args = trainer.model_args
    attn = "eager" if args.attn_softcap is not None else "sdpa"
    cfg = AutoConfig.for_model(**hf_config_from_model_args(args), use_cache=False)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation=attn)
    model.load_state_dict(to_hf_state_dict(trainer.model.state_dict(), args), strict=True)
    model.train()
    ours = trainer.optimizer
    groups = [{"params": [], "weight_decay": g["weight_decay"]} for g in ours.param_groups]
    for p in model.parameters():
        groups[0 if p.ndim >= 2 else 1]["params"].append(p)
    assert [g["weight_decay"] for g in ours.param_groups][1] == 0.0
    d = ours.defaults
    kernel = {k: d[k] for k in ("fused", "foreach") if d.get(k) is not None}
    opt = torch.optim.AdamW(groups, lr=ours.param_groups[0]["lr"], betas=d["betas"], eps=d["eps"],
                            **kernel)
    if compiled:
        model = torch.compile(model)
    return model, opt


def baseline_step(model: torch.nn.Module, opt: torch.optim.Optimizer, batch: Batch, dtype: str,
                  max_norm: float) -> tuple[float, float]:
    """The textbook loop: forward (autocast), mean token CE in fp32, backward, clip, step."""
    x, y = batch
    if dtype == "bf16":
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = model(input_ids=x).logits
    else:
        logits = model(input_ids=x).logits
    loss = F.cross_entropy(logits.flatten(0, 1).float(), y.flatten())
    loss.backward()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss.item(), float(norm)


def random_batches(n: int, batch: int, seq_len: int, vocab: int) -> list[Batch]:
    g = torch.Generator().manual_seed(1234)
    out = []
    for _ in range(n):
        window = torch.randint(0, vocab, (batch, seq_len + 1), generator=g)
        out.append((window[:, :-1].contiguous(), window[:, 1:].contiguous()))
    return out


# --- measuring ----------------------------------------------------------------------------------
def summarize(times: list[float], tokens: int) -> dict[str, Any]:
    med = statistics.median(times)
    return {
        "step_times_s": [round(t, 5) for t in times],
        "median_step_s": med,
        "tokens_per_s": tokens / med,
        "tokens_per_s_mean": tokens * len(times) / sum(times),
        "tokens_per_s_best": tokens / min(times),
    }


def run_variant(a: argparse.Namespace, name: str, batches: list[Batch], workdir: Path) -> dict:
    dtype, mode = name.split("-")
    compiled = mode == "compiled"
    t0 = time.perf_counter()
    trainer = build_ours(a, dtype, compiled, workdir / name)
    model, opt = build_baseline(trainer, compiled)
    max_norm = trainer.cfg.training.max_grad_norm or float("inf")
    d = trainer.optimizer.defaults
    optim = {k: (list(v) if isinstance(v, tuple) else v) for k, v in d.items()
             if k in ("betas", "eps", "fused", "foreach")}
    optim["groups"] = [
        {"lr": g["lr"], "weight_decay": g["weight_decay"], "params": len(g["params"])}
        for g in trainer.optimizer.param_groups
    ]
    build_s = time.perf_counter() - t0
    steps: dict[str, Callable[[Batch], tuple[float, float]]] = {
        "ours": lambda b: trainer.train_step([b]),
        "baseline": lambda b: baseline_step(model, opt, b, dtype, max_norm),
    }
    first: dict[str, dict[str, float]] = {}
    warm_s: dict[str, float] = {}
    for side, fn in steps.items():  # warmup (compilation happens here)
        t = time.perf_counter()
        for i in range(a.warmup):
            loss, norm = fn(batches[i % len(batches)])
            if i == 0:
                first[side] = {"loss": loss, "grad_norm": norm}
        warm_s[side] = time.perf_counter() - t
    times: dict[str, list[float]] = {"ours": [], "baseline": []}
    for i in range(a.steps):  # ABBA: ours, base, base, ours, ours, base, ...
        order = ("ours", "baseline") if i % 2 == 0 else ("baseline", "ours")
        batch = batches[(a.warmup + i) % len(batches)]
        for side in order:
            t = time.perf_counter()
            steps[side](batch)
            times[side].append(time.perf_counter() - t)
    tokens = a.batch * a.seq_len
    result = {
        "dtype": dtype, "compiled": compiled, "build_s": build_s, "warmup_s": warm_s,
        "first_step": first, "optimizer": optim, "max_grad_norm": max_norm,
        "ours": summarize(times["ours"], tokens),
        "baseline": summarize(times["baseline"], tokens),
    }
    result["ratio"] = result["ours"]["tokens_per_s"] / result["baseline"]["tokens_per_s"]
    return result


# --- reporting ----------------------------------------------------------------------------------
def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def environment(threads: int) -> dict[str, Any]:
    import transformers

    return {
        "torch": torch.__version__, "transformers": transformers.__version__,
        "python": platform.python_version(), "cpu": cpu_name(), "cpu_count": os.cpu_count(),
        "threads": threads, "avx512_bf16": bool(torch.cpu._is_avx512_bf16_supported()),
        "platform": platform.platform(),
        "load_average_at_start": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
    }


def print_table(results: dict[str, Any]) -> None:
    cols = list(results["variants"])
    rows = [
        ("scaletrain tok/s", [f"{results['variants'][c]['ours']['tokens_per_s']:,.0f}"
                              for c in cols]),
        ("transformers tok/s", [f"{results['variants'][c]['baseline']['tokens_per_s']:,.0f}"
                                for c in cols]),
        ("ours / baseline", [f"{results['variants'][c]['ratio']:.2f}x" for c in cols]),
    ]
    skipped = results.get("skipped", {})
    title = (f"train step tokens/s (median of {results['config']['steps']} steps, batch "
             f"{results['config']['batch']} x {results['config']['seq_len']}, "
             f"{results['environment']['threads']} threads)")
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:  # plain text
        print(title)
        print(f"{'':20}" + "".join(f"{c:>16}" for c in cols))
        for label, vals in rows:
            print(f"{label:20}" + "".join(f"{v:>16}" for v in vals))
    else:
        table = Table(title=title)
        table.add_column("")
        for c in cols:
            table.add_column(c, justify="right")
        for label, vals in rows:
            table.add_row(label, *vals)
        Console().print(table)
    for name, why in skipped.items():
        print(f"{name}: skipped ({why})")


def write_json(path: Path, data: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=1) + "\n")
    tmp.replace(path)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    a = parse_args(argv)
    logging.basicConfig(level=logging.INFO if a.verbose else logging.ERROR,
                        format="%(levelname)s %(name)s: %(message)s")
    if not a.verbose:
        logging.getLogger("scaletrain").setLevel(logging.ERROR)
    if a.threads:
        torch.set_num_threads(a.threads)
    wanted = [v.strip() for v in a.variants.split(",") if v.strip()]
    unknown = sorted(set(wanted) - set(VARIANTS))
    if unknown:
        raise SystemExit(f"--variants: unknown {unknown}; choose from {', '.join(VARIANTS)}")
    skipped: dict[str, str] = {}
    todo = []
    for name in VARIANTS:
        if name not in wanted:
            continue
        if a.skip_compile and name.endswith("compiled"):
            skipped[name] = "--skip-compile"
        elif name.startswith("bf16") and not torch.cpu._is_avx512_bf16_supported():
            skipped[name] = "CPU has no AVX-512 bf16 (bf16 would be emulated and slow)"
        else:
            todo.append(name)
    batches = random_batches(4, a.batch, a.seq_len, a.vocab)
    results: dict[str, Any] = {
        "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(a).items()},
        "environment": environment(torch.get_num_threads()),
        "variants": {}, "skipped": skipped,
    }
    with tempfile.TemporaryDirectory(prefix="bench-train-cpu-") as tmp:
        for name in todo:
            print(f"running {name} ...", file=sys.stderr, flush=True)
            results["variants"][name] = r = run_variant(a, name, batches, Path(tmp))
            gc.collect()  # free this variant's models before the next is built
            torch._dynamo.reset()
            print(f"  ours {r['ours']['tokens_per_s']:,.0f} tok/s, transformers "
                  f"{r['baseline']['tokens_per_s']:,.0f} tok/s, ratio {r['ratio']:.2f}; first "
                  f"loss {r['first_step']['ours']['loss']:.4f} vs "
                  f"{r['first_step']['baseline']['loss']:.4f}", file=sys.stderr, flush=True)
    if hasattr(os, "getloadavg"):  # other processes on the machine distort timings
        results["environment"]["load_average_at_end"] = list(os.getloadavg())
    write_json(a.json, results)
    print_table(results)
    print(f"results written to {a.json}")
    return results


if __name__ == "__main__":
    main()
