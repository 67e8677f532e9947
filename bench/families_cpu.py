"""Training throughput per model family on CPU: scaletrain's `Trainer.train_step` against a
plain PyTorch loop over transformers' model of the same family (Qwen2ForCausalLM, ...), with
the same dimensions, weights, batch and optimizer, fp32 and bf16 autocast, in one run.

    python bench/families_cpu.py                      # llama + the five families, 17M dims
    python bench/families_cpu.py --families qwen3,gemma2 --steps 4

Each family is its `debug-<family>` preset (docs/models.md) at the dimensions given here; the
measuring (ABBA order, warmup excluded, medians) is `bench/train_cpu.py`'s. Results: a table
and JSON (default bench/results/families_cpu.json).
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results" / "families_cpu.json"
FAMILIES = ("llama", "qwen2", "qwen3", "mistral", "phi3", "gemma2")


def _train_cpu() -> Any:
    path = ROOT / "bench" / "train_cpu.py"
    spec = importlib.util.spec_from_file_location("bench_train_cpu", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main(argv: list[str] | None = None) -> dict[str, Any]:
    tc = _train_cpu()
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--families", default=",".join(FAMILIES))
    p.add_argument("--out", type=Path, default=RESULTS, help="where to write the results")
    own, rest = p.parse_known_args(argv)
    a = tc.parse_args([*rest, "--json", str(own.out)])
    variants = ["fp32-eager"]
    skipped = {}
    if torch.cpu._is_avx512_bf16_supported():
        variants.append("bf16-eager")
    else:
        skipped["bf16-eager"] = "CPU has no AVX-512 bf16 (bf16 would be emulated and slow)"
    if a.threads:
        torch.set_num_threads(a.threads)
    import logging

    logging.getLogger("scaletrain").setLevel(logging.ERROR)
    batches = tc.random_batches(4, a.batch, a.seq_len, a.vocab)
    results: dict[str, Any] = {
        "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(a).items()},
        "environment": tc.environment(torch.get_num_threads()), "families": {},
        "skipped": skipped,
    }
    with tempfile.TemporaryDirectory(prefix="bench-families-") as tmp:
        for fam in [f.strip() for f in own.families.split(",") if f.strip()]:
            a.model_name = "debug" if fam == "llama" else f"debug-{fam}"
            results["families"][fam] = {}
            for name in variants:
                print(f"running {fam} {name} ...", file=sys.stderr, flush=True)
                r = tc.run_variant(a, name, batches, Path(tmp) / fam)
                results["families"][fam][name] = r
                gc.collect()
                print(f"  ours {r['ours']['tokens_per_s']:,.0f} tok/s, transformers "
                      f"{r['baseline']['tokens_per_s']:,.0f} tok/s, ratio {r['ratio']:.2f}; "
                      f"first loss {r['first_step']['ours']['loss']:.4f} vs "
                      f"{r['first_step']['baseline']['loss']:.4f}", file=sys.stderr, flush=True)
    if hasattr(os, "getloadavg"):
        results["environment"]["load_average_at_end"] = list(os.getloadavg())
    tc.write_json(own.out, results)
    print(f"train step tokens/s (median of {a.steps} steps, batch {a.batch} x {a.seq_len}, "
          f"{results['environment']['threads']} threads)")
    print(f"{'family':10}{'variant':>12}{'scaletrain':>12}{'transformers':>14}{'ratio':>8}")
    for fam, rows in results["families"].items():
        for name, r in rows.items():
            print(f"{fam:10}{name:>12}{r['ours']['tokens_per_s']:>12,.0f}"
                  f"{r['baseline']['tokens_per_s']:>14,.0f}{r['ratio']:>7.2f}x")
    print(f"results written to {own.out}")
    return results


if __name__ == "__main__":
    main()
