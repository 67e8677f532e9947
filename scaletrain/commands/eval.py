"""`scaletrain eval --checkpoint DIR --tasks T1,T2 [--include-path DIR]`: lm-evaluation-harness
tasks on any model directory (native checkpoint, training run, Hugging Face folder, fine-tuned
run), in-process. Prints lm_eval's results table; `--output FILE` also writes the results JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="scaletrain eval", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint", required=True, metavar="DIR", help="any model directory")
    p.add_argument("--tasks", required=True,
                   help="comma-separated lm_eval task (or group) names")
    p.add_argument("--include-path", metavar="DIR", default=None,
                   help="a directory of your own task YAML files")
    p.add_argument("--num-fewshot", type=int, default=None)
    p.add_argument("--limit", type=float, default=None,
                   help="examples per task (a fraction below 1.0)")
    p.add_argument("--batch-size", type=int, default=8, help="sequences scored together")
    p.add_argument("--max-gen-toks", type=int, default=256,
                   help="generate_until budget when a task sets none")
    p.add_argument("--add-bos-token", choices=("auto", "true", "false"), default="auto",
                   help="auto: the tokenizer's own special tokens (e.g. Llama's and Gemma's BOS), "
                        "as lm_eval's hf model encodes; true/false: force them on/off")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--bootstrap-iters", type=int, default=1000,
                   help="bootstrap resamples for standard errors (0: none; lm_eval's own "
                        "default of 100000 takes minutes on a CPU)")
    p.add_argument("--output", metavar="FILE", default=None, help="write the results JSON")
    return p


def task_manager(tasks: list[str], include_path: str | None) -> Any:
    """lm_eval's task index: only `include_path` when it holds every task asked for (indexing
    lm_eval's thousands of built-in tasks takes tens of seconds), else built-in + yours."""
    from lm_eval.tasks import TaskManager

    if include_path:
        local = TaskManager(include_path=include_path, include_defaults=False)
        if all(t in local.all_tasks for t in tasks):
            return local
    manager = TaskManager(include_path=include_path)
    unknown = [t for t in tasks if t not in manager.all_tasks]
    if unknown:
        raise ValueError(f"unknown lm_eval task(s) {unknown}; list them with `lm_eval ls "
                         "tasks`, or give your own YAML directory with --include-path")
    return manager


def run(args: argparse.Namespace, log_samples: bool = False) -> dict[str, Any]:
    """lm_eval's results dict (plus "scaletrain": timing) for the parsed arguments."""
    from lm_eval import simple_evaluate

    from scaletrain.evaluation.harness import ScaletrainLM

    if args.batch_size < 1:
        raise ValueError(f"--batch-size must be >= 1 (got {args.batch_size})")
    tasks = [t.strip() for t in args.tasks.split(",") if t.strip()]
    if not tasks:
        raise ValueError("--tasks is empty; name at least one lm_eval task")
    if args.include_path and not Path(args.include_path).is_dir():
        raise ValueError(f"--include-path {args.include_path} is not a directory")
    t0 = time.perf_counter()
    lm = ScaletrainLM(checkpoint=args.checkpoint, batch_size=args.batch_size,
                      device=args.device, max_gen_toks=args.max_gen_toks,
                      add_bos_token={"auto": None, "true": True, "false": False}[
                          getattr(args, "add_bos_token", "auto")])
    loaded = time.perf_counter()
    manager = task_manager(tasks, args.include_path)
    results = simple_evaluate(
        model=lm, tasks=tasks, num_fewshot=args.num_fewshot, limit=args.limit,
        task_manager=manager, log_samples=log_samples, bootstrap_iters=args.bootstrap_iters,
        random_seed=args.seed,
        numpy_random_seed=args.seed, torch_random_seed=args.seed,
        fewshot_random_seed=args.seed)
    if results is None:  # pragma: no cover - non-zero ranks only
        raise RuntimeError("lm_eval returned no results")
    results["scaletrain"] = {"checkpoint": str(args.checkpoint),
                             "load_s": round(loaded - t0, 3),
                             "eval_s": round(time.perf_counter() - loaded, 3)}
    return results


def main(argv: list[str]) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:
        return int(e.code or 0)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    try:
        results = run(args)
    except (OSError, ValueError, KeyError, RuntimeError) as e:
        print(f"scaletrain eval: error: {e}", file=sys.stderr)
        return 2
    from lm_eval.utils import make_table

    print(make_table(results))
    if args.output:
        out = Path(args.output)
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_suffix(out.suffix + ".tmp")
        tmp.write_text(json.dumps({k: results[k] for k in ("results", "versions", "n-shot",
                                                            "configs", "scaletrain")
                                   if k in results}, indent=2, default=str))
        tmp.replace(out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
