"""`training.fused_loss` in fine-tuning (SFT): the chunked head + cross-entropy of pre-training
(`train/chunked_loss.py`) gives the losses and first-step gradients of the plain logits path,
with masked prompt tokens, 2 accumulation steps and clipping: LoRA, full and QLoRA on one
process (packed rows), and LoRA under FSDP (ZeRO-3), full under DDP and LoRA under tensor
parallelism 2 (the vocabulary-parallel chunked loss; one example per row) on 2 gloo ranks
against one unfused process on the same global batches."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from scaletrain.config import load_config
from scaletrain.train import chunked_loss
from scaletrain.train.step import full_value
from scaletrain.train.trainer import Trainer
from tests.finetune.distributed.test_finetune_ddp import _argv
from tests.helpers.dist_worker import train_steps
from tests.helpers.finetune import qa_records, write_jsonl
from tests.helpers.proc import run_ranks
from tests.helpers.trainer import tiny_config

TOL = 1e-5
STEPS = 2
FUSED = ["--training.fused_loss", "true", "--training.loss_chunk_tokens", "100"]


def _run(argv: list[str]) -> dict[str, Any]:
    """Losses of STEPS steps, the whole reduced gradients of the first (before its update),
    the validation loss after them, and the calls of the chunked loss in each."""
    from scaletrain.finetune.trainer import FinetuneTrainer

    calls = []
    fn = chunked_loss.ChunkedLinearCrossEntropy
    plain = fn.forward  # the chunked loss, plain or vocabulary-parallel

    def counted(ctx: Any, *a: Any) -> torch.Tensor:
        calls.append(1)
        return plain(ctx, *a)

    fn.forward = staticmethod(counted)  # type: ignore[method-assign]
    try:
        trainer = FinetuneTrainer(load_config(argv, prog="scaletrain finetune"))
        losses, grads = train_steps(trainer, STEPS, lambda: {
            n.replace("_fsdp_wrapped_module.", ""): full_value(p.grad).detach().clone()
            for n, p in trainer.core.named_parameters() if p.grad is not None})
        train_calls = len(calls)
        val = trainer.evaluate()  # validation takes the training step's loss path
    finally:
        fn.forward = staticmethod(plain)  # type: ignore[method-assign]
    return {"losses": losses, "grads": grads, "fused_calls": train_calls, "val": val,
            "val_calls": len(calls) - train_calls}


def _entry(rank: int, world: int, jobs: list[list[str]], out_dir: str) -> None:
    torch.save([_run(argv) for argv in jobs], Path(out_dir) / f"rank{rank}.pt")


def _argv_of(out: Path, base: Path, data: Path, method: str, mbs: int, mode: str = "ddp",
             fused: bool = False, *extra: str) -> list[str]:
    argv = _argv(out, base, data, method, "sft", mbs)  # clipping at 1.0, GA 2, fp32
    argv[argv.index("--parallel.data_parallel") + 1] = mode
    argv[argv.index("--training.steps") + 1] = str(STEPS)
    return [*argv, *extra, *(FUSED if fused else [])]


def _close(got: dict[str, Any], ref: dict[str, Any], what: str) -> None:
    assert got["fused_calls"] == STEPS * 2 and ref["fused_calls"] == 0, what  # GA 2
    assert got["val_calls"] > 0 and ref["val_calls"] == 0, what
    assert abs(got["val"] - ref["val"]) <= TOL * abs(ref["val"]), (what, got["val"], ref["val"])
    for a, b in zip(got["losses"], ref["losses"], strict=True):
        assert abs(a - b) <= TOL * abs(b), (what, got["losses"], ref["losses"])
    assert got["grads"].keys() == ref["grads"].keys() and ref["grads"]
    for name, g in ref["grads"].items():
        diff = (got["grads"][name] - g).abs().max().item()
        assert diff <= 2e-6 * max(g.abs().max().item(), 1e-6), (what, name, diff)


@pytest.fixture(scope="module")
def base_and_data(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, Path]:
    root = tmp_path_factory.mktemp("ft-fused")
    Trainer(tiny_config(root / "base", root / "cache", "--training.steps", "2")).train()
    return root / "base", write_jsonl(root / "sft.jsonl", qa_records(32)), root


@pytest.fixture(scope="module")
def plain_runs(base_and_data: tuple[Path, Path, Path]) -> dict[str, dict[str, Any]]:
    """One unfused process (logits path) of each method, the reference of both tests."""
    base, sft, root = base_and_data
    return {m: _run(_argv_of(root / f"plain-{m}", base, sft, m, 4, "ddp", False, *extra))
            for m, extra in CASES}


CASES = (("lora", ()), ("full", ()), ("qlora", ("--finetune.quant_compute_dtype", "fp32")))


def test_fused_loss_matches_the_logits_path_on_one_process(
        base_and_data: tuple[Path, Path, Path], plain_runs: dict[str, dict[str, Any]],
        tmp_path: Path) -> None:
    base, sft, _ = base_and_data
    for method, extra in CASES:  # (packed rows: the default)
        fused = _run(_argv_of(tmp_path / method, base, sft, method, 4, "ddp", True, *extra))
        _close(fused, plain_runs[method], method)


@pytest.mark.distributed
def test_fused_loss_under_fsdp_and_ddp_matches_one_unfused_process(
        base_and_data: tuple[Path, Path, Path], plain_runs: dict[str, dict[str, Any]],
        tmp_path: Path) -> None:
    base, sft, _ = base_and_data
    tp = ("--parallel.tp", "2")  # vocabulary-parallel: each rank its half of the head
    cases = [("lora", "zero3", 2, ()), ("full", "ddp", 2, ()),
             ("lora", "ddp", 4, (*tp, "--finetune.packing", "false"))]
    run_ranks(_entry, 2, [_argv_of(tmp_path / f"dp-{i}", base, sft, m, mbs, mode, True, *extra)
                          for i, (m, mode, mbs, extra) in enumerate(cases)], str(tmp_path))
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(2)]
    for i, (method, mode, _, extra) in enumerate(cases):
        ref = plain_runs[method]
        if "--finetune.packing" in extra:  # one example per row: its own reference
            ref = _run(_argv_of(tmp_path / "plain-rows", base, sft, method, 4, "ddp", False,
                                "--finetune.packing", "false"))
        for r in range(2):  # every rank: the one process's losses and reduced gradients
            _close(ranks[r][i], ref, f"{method} {mode} {extra} rank {r}")
