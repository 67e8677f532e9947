"""Fine-tuning under DDP: 2 ranks of LoRA SFT and of full classification give the losses (3
steps), the first step's gradients and the validation loss of one process on the same global
batches, with the defaults on (gradient clipping) and 2 accumulation steps; SFT rows hold
different numbers of scored tokens, so this checks the token-weighted normalization too."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from scaletrain.config import load_config
from scaletrain.train.trainer import Trainer
from tests.helpers.dist_worker import train_steps
from tests.helpers.finetune import qa_records, sentiment_records, write_jsonl
from tests.helpers.proc import run_ranks
from tests.helpers.trainer import tiny_config

TOL = 1e-5
STEPS = 3


def _argv(out: Path, base: Path, data: Path, method: str, task: str, mbs: int) -> list[str]:
    return ["--config", "finetune", "--output", str(out), "--finetune.base", str(base),
            "--finetune.data", str(data), "--finetune.method", method, "--finetune.task", task,
            "--finetune.lora_rank", "4", "--finetune.lora_dropout", "0",
            "--data.seq_len", "64", "--training.micro_batch_size", str(mbs),
            "--training.grad_accum_steps", "2", "--training.steps", str(STEPS),
            "--training.eval_interval", "0", "--lr_schedule.warmup_steps", "1",
            "--checkpoint.save_final", "false",
            "--optimizer.lr", "1e-2", "--metrics.tensorboard", "false",
            "--metrics.progress_bar", "false", "--precision.dtype", "fp32",
            "--parallel.data_parallel", "ddp"]


def _run(argv: list[str]) -> dict[str, Any]:
    """Losses of STEPS steps and the (all-reduced) gradients of the first, before its update."""
    from scaletrain.finetune.trainer import FinetuneTrainer

    trainer = FinetuneTrainer(load_config(argv, prog="scaletrain finetune"))
    losses, grads = train_steps(trainer, STEPS, lambda: {
        n: p.grad.detach().clone() for n, p in trainer.core.named_parameters()
        if p.grad is not None})
    return {"losses": losses, "grads": grads, "val": trainer.evaluate()}


def _entry(rank: int, world: int, jobs: list[list[str]], out_dir: str) -> None:
    results = [_run(argv) for argv in jobs]
    torch.save(results, Path(out_dir) / f"rank{rank}.pt")


@pytest.mark.distributed
def test_ddp_fine_tuning_matches_one_process(tmp_path: Path) -> None:
    base = tmp_path / "base"
    Trainer(tiny_config(base, tmp_path / "cache", "--training.steps", "2")).train()
    sft = write_jsonl(tmp_path / "sft.jsonl", qa_records(64))
    cls = write_jsonl(tmp_path / "cls.jsonl", sentiment_records(60))
    cases = [("lora", "sft", sft), ("full", "classification", cls)]
    refs = [_run(_argv(tmp_path / f"ref-{m}", base, d, m, t, 8)) for m, t, d in cases]
    jobs = [_argv(tmp_path / f"ddp-{m}", base, d, m, t, 4) for m, t, d in cases]
    run_ranks(_entry, 2, jobs, str(tmp_path))
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(2)]
    for i, (method, _, _) in enumerate(cases):
        ref, got = refs[i], ranks[0][i]
        for a, b in zip(got["losses"], ref["losses"], strict=True):
            assert abs(a - b) <= TOL * abs(b), (method, got["losses"], ref["losses"])
        for r in range(2):  # the validation split dealt to the ranks: one process's value
            assert abs(ranks[r][i]["val"] - ref["val"]) <= TOL * ref["val"], (method, r)
        assert got["grads"].keys() == ref["grads"].keys() and ref["grads"]
        for name, g in ref["grads"].items():
            for r in range(2):  # every rank holds the same, all-reduced gradient
                diff = (ranks[r][i]["grads"][name] - g).abs().max().item()
                assert diff <= 2e-6 * max(g.abs().max().item(), 1e-6), (method, name, r, diff)
