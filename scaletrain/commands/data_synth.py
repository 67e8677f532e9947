"""`scaletrain data synth`: generate candidates with an LLM, critique them, keep what passes.

    scaletrain data synth --config SYNTH.toml
    scaletrain data synth --checkpoint runs/debug --topics "rain,rivers,tides" --out runs/synth
    scaletrain data synth --url http://127.0.0.1:8000/v1 --num-prompts 100 --min-score 7

Flags override the TOML. Re-running the same command resumes: prompts already in
OUT/candidates.jsonl are not generated again. Exit 3: a token/request budget ran out (re-run).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from typing import Any

from scaletrain.commands._checkpoint_flags import add_trust_flags, trust_settings

logger = logging.getLogger(__name__)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="scaletrain data synth",
                                description=__doc__.split("\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="\n".join(__doc__.split("\n")[2:]))
    p.add_argument("--config", help="SYNTH.toml ([generator], [judge], [prompts], [filters])")
    p.add_argument("--out", help="output directory (default runs/synth)")
    p.add_argument("--checkpoint", help="generate in-process from this checkpoint")
    p.add_argument("--url", help="or from an OpenAI-compatible server (…/v1)")
    p.add_argument("--model", help="model name sent to the server")
    p.add_argument("--chat", action="store_true", help="use /v1/chat/completions")
    p.add_argument("--template", help="prompt template with {slots}, e.g. 'Explain {topic}.'")
    p.add_argument("--topics", help="comma-separated values of the {topic} slot")
    p.add_argument("--topics-file", help="file with one topic per line (or .jsonl 'text')")
    p.add_argument("--num-prompts", type=int)
    p.add_argument("--candidates", "-n", type=int, help="candidates per prompt")
    p.add_argument("--seed", type=int)
    p.add_argument("--max-new-tokens", type=int)
    p.add_argument("--temperature", type=float)
    p.add_argument("--batch-size", type=int, help="in-process batch size")
    p.add_argument("--concurrency", type=int, help="HTTP requests in flight")
    p.add_argument("--judge", choices=["llm", "classifier", "none"], help="critique kind")
    p.add_argument("--min-score", type=float, help="drop candidates scored below this")
    p.add_argument("--dedup-corpus", action="append", help="dedup against these documents")
    p.add_argument("--eval", action="append", help="decontaminate against this eval file")
    add_trust_flags(p)
    return p


def overrides(a: argparse.Namespace) -> dict[str, Any]:
    pairs = {"output": a.out, "generator.checkpoint": a.checkpoint, "generator.url": a.url,
             "generator.model": a.model, "prompts.template": a.template,
             "prompts.num_prompts": a.num_prompts, "prompts.candidates": a.candidates,
             "prompts.seed": a.seed, "generator.max_new_tokens": a.max_new_tokens,
             "generator.temperature": a.temperature, "generator.batch_size": a.batch_size,
             "generator.concurrency": a.concurrency, "judge.kind": a.judge,
             "filters.min_score": a.min_score, "filters.dedup_corpus": a.dedup_corpus,
             "filters.decontaminate": a.eval,
             "prompts.slots.topic": a.topics.split(",") if a.topics else None,
             "prompts.slot_files.topic": a.topics_file}
    out = {k: v for k, v in pairs.items() if v is not None}
    if a.chat:
        out["generator.chat"] = True
    if a.url:
        out["generator.checkpoint"] = ""
    elif a.checkpoint:
        out["generator.url"] = ""
    return out


def main(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    from scaletrain.synth.config import load_config
    from scaletrain.synth.runner import SynthRunner

    try:
        cfg = load_config(args.config, overrides(args))
        with trust_settings(args):
            summary = SynthRunner(cfg).run()
    except (ValueError, FileNotFoundError) as e:
        print(f"scaletrain data synth: {e}", file=sys.stderr)
        return 2
    except RuntimeError as e:  # a server that fails for good, a spent budget, a failed task
        from scaletrain.inference.generators import BudgetExhausted

        print(f"scaletrain data synth: {e}\nwhat is done is kept; run again to resume",
              file=sys.stderr)
        return 3 if isinstance(e, BudgetExhausted) or isinstance(e.__cause__,
                                                                  BudgetExhausted) else 1
    print(json.dumps({k: summary[k] for k in ("prompts", "generated", "kept", "dropped",
                                              "critique_unparsable", "complete")}))
    print(f"wrote {cfg.output}/candidates.jsonl, kept.jsonl, stats.json, report.html")
    return 0 if summary["complete"] else 3
