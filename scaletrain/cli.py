"""`scaletrain <verb> ...`: one entry point, one function per verb.

Verb modules are imported only when used, so `scaletrain models` does not pay for torch
start-up of the trainer, and a verb's optional dependencies stay optional.
"""

from __future__ import annotations

import importlib
import logging
import os
import sys
from collections.abc import Callable

VERBS: dict[str, tuple[str, str]] = {
    "train": ("scaletrain.commands.train", "train a model (no arguments: the debug demo)"),
    "models": ("scaletrain.commands.models", "list the model presets and their sizes"),
    "generate": ("scaletrain.commands.generate", "sample from a checkpoint with a KV cache"),
    "convert": ("scaletrain.commands.convert", "Hugging Face <-> native checkpoints"),
    "data": ("scaletrain.commands.data", "corpus pipeline: curate, dedup, tokenize, inspect, ..."),
    "profile": ("scaletrain.commands.profile", "profile a few training steps, then diagnose"),
    "diagnose": ("scaletrain.commands.diagnose", "bottleneck verdict and remedies from traces"),
    "plan": ("scaletrain.commands.plan", "memory/FLOPs/communication of a layout; layout search"),
    "finetune": ("scaletrain.commands.finetune", "adapt a model: full, freeze, LoRA, QLoRA; SFT or "
                 "classification"),
    "predict": ("scaletrain.commands.predict", "run a fine-tuned model on new texts"),
    "launch": ("scaletrain.commands.launch", "write a Slurm sbatch script for a multi-node run"),
    "serve": ("scaletrain.commands.serve", "OpenAI-compatible HTTP endpoint over a checkpoint"),
    "eval": ("scaletrain.commands.eval", "lm-evaluation-harness tasks on a model, in-process"),
    "tune": ("scaletrain.commands.tune", "measure the search's best layouts here; keep the "
             "fastest"),
}


def _usage() -> str:
    lines = ["usage: scaletrain <verb> [options]", "", "verbs:"]
    lines += [f"  {name:<10} {help_}" for name, (_, help_) in VERBS.items()]
    lines += ["", "`scaletrain <verb> --help` shows a verb's options."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if not argv:
        argv = ["train"]
    if argv[0] in ("-h", "--help", "help"):
        print(_usage())
        return 0
    if argv[0] in ("-V", "--version"):
        from scaletrain import __version__

        print(f"scaletrain {__version__}")
        return 0
    verb, rest = argv[0], argv[1:]
    if verb not in VERBS:
        import difflib

        near = difflib.get_close_matches(verb, VERBS, n=1)
        hint = f" Did you mean '{near[0]}'?" if near else ""
        print(f"scaletrain: unknown verb '{verb}'.{hint}\n\n{_usage()}", file=sys.stderr)
        return 2
    run: Callable[[list[str]], int] = importlib.import_module(VERBS[verb][0]).main
    return run(rest)


# Verbs that start process groups under torchrun.
_DISTRIBUTED_VERBS = ("train", "finetune", "profile")


def entry() -> None:
    """The `scaletrain` console script and `python -m scaletrain` (what torchrun starts).

    A rank torchrun started (WORLD_SIZE > 1) of a verb that ran process groups leaves with
    `os._exit` once the verb has returned, its output flushed: torch's DTensor caches keep a
    trained model's meshes (and their gloo/NCCL threads) until interpreter shutdown, whose
    teardown of them can abort a finished rank ("terminate called without an active
    exception", SIGABRT), and torchrun would then report a successful run as failed. The verb
    has already closed its files and destroyed its groups (`shutdown_process_group`).
    """
    argv = sys.argv[1:]
    rc = main(argv)
    verb = argv[0] if argv else "train"
    if int(os.environ.get("WORLD_SIZE", "1")) > 1 and verb in _DISTRIBUTED_VERBS:
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(rc)
    raise SystemExit(rc)


if __name__ == "__main__":
    entry()
