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
    p.add_argument("--output", "--output_path", metavar="FILE", default=None,
                   help="write the results JSON (a .json path; with --log_samples the "
                        "per-sample logs go next to it, as lm_eval writes them)")
    p.add_argument("--log_samples", "--log-samples", action="store_true",
                   help="write every sample's prompt, responses and metrics "
                        "(samples_<task>_<date>.jsonl next to --output, with lm_eval's "
                        "results_<date>.json)")
    p.add_argument("--apply_chat_template", "--apply-chat-template", nargs="?", const=True,
                   default=False, metavar="TEMPLATE",
                   help="prompt through the model's chat template (as lm_eval's flag)")
    p.add_argument("--fewshot_as_multiturn", "--fewshot-as-multiturn", nargs="?", const=True,
                   default=None, type=lambda x: x.lower() in ("true", "1", "yes"),
                   help="few-shot examples as conversation turns (on by default with "
                        "--apply_chat_template, as in lm_eval)")
    p.add_argument("--system_instruction", "--system-instruction", default=None, metavar="TEXT",
                   help="a system message before every prompt")
    p.add_argument("--gen_kwargs", "--gen-kwargs", nargs="+", default=None, metavar="K=V",
                   help="generation settings for generate_until tasks, e.g. "
                        "temperature=0,max_gen_toks=64 (temperature, top_p, top_k, "
                        "max_gen_toks, until, do_sample)")
    return p


def _chat_flags(args: argparse.Namespace) -> tuple[bool | str, bool]:
    """(apply_chat_template, fewshot_as_multiturn) resolved as lm_eval's CLI resolves them."""
    apply = getattr(args, "apply_chat_template", False) or False
    multiturn = getattr(args, "fewshot_as_multiturn", None)
    if multiturn and not apply:
        raise ValueError("--fewshot_as_multiturn needs --apply_chat_template")
    return apply, bool(apply) if multiturn is None else bool(multiturn)


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


def run(args: argparse.Namespace, log_samples: bool = False,
        tracker: Any = None) -> dict[str, Any]:
    """lm_eval's results dict (plus "scaletrain": timing) for the parsed arguments."""
    from lm_eval import simple_evaluate
    from lm_eval.utils import simple_parse_args_string

    from scaletrain.evaluation.harness import ScaletrainLM

    if args.batch_size < 1:
        raise ValueError(f"--batch-size must be >= 1 (got {args.batch_size})")
    tasks = [t.strip() for t in args.tasks.split(",") if t.strip()]
    if not tasks:
        raise ValueError("--tasks is empty; name at least one lm_eval task")
    if args.include_path and not Path(args.include_path).is_dir():
        raise ValueError(f"--include-path {args.include_path} is not a directory")
    apply_chat, multiturn = _chat_flags(args)
    gen_kwargs = getattr(args, "gen_kwargs", None)
    if gen_kwargs:
        gen_kwargs = simple_parse_args_string(",".join(gen_kwargs))
    t0 = time.perf_counter()
    lm = ScaletrainLM(checkpoint=args.checkpoint, batch_size=args.batch_size,
                      device=args.device, max_gen_toks=args.max_gen_toks,
                      add_bos_token={"auto": None, "true": True, "false": False}[
                          getattr(args, "add_bos_token", "auto")])
    loaded = time.perf_counter()
    manager = task_manager(tasks, args.include_path)
    results = simple_evaluate(
        model=lm, tasks=tasks, num_fewshot=args.num_fewshot, limit=args.limit,
        task_manager=manager, log_samples=log_samples or getattr(args, "log_samples", False),
        bootstrap_iters=args.bootstrap_iters, evaluation_tracker=tracker,
        system_instruction=getattr(args, "system_instruction", None),
        apply_chat_template=apply_chat, fewshot_as_multiturn=multiturn, gen_kwargs=gen_kwargs,
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
    if args.log_samples and not args.output:
        print("scaletrain eval: error: --log_samples needs --output FILE.json (the samples are "
              "written next to it)", file=sys.stderr)
        return 2
    tracker = None
    if args.log_samples:
        from lm_eval.loggers import EvaluationTracker

        tracker = EvaluationTracker(output_path=str(Path(args.output).with_suffix(".json")))
    try:
        results = run(args, tracker=tracker)
    except (OSError, ValueError, KeyError, RuntimeError) as e:
        print(f"scaletrain eval: error: {e}", file=sys.stderr)
        return 2
    from lm_eval.utils import make_table

    print(make_table(results))
    if tracker is not None:  # lm_eval's own writer: the same files as `lm_eval --log_samples`
        samples = results.pop("samples")
        tracker.save_results_aggregated(results=results, samples=samples)
        for task in results["configs"]:
            tracker.save_results_samples(task_name=task, samples=samples[task])
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
