"""Fine-tuning under FSDP (ZeRO-2/3): 2 ranks of LoRA SFT (zero3) and of full classification
(zero2) give the losses (3 steps of 2 micro-batches, clipping at 1.0) and the first step's
gradients of one process on the same global batches; the LoRA adapter they write equals its
adapter, and a run resumed from their checkpoint continues as they did."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file
from torch.distributed.tensor import DTensor

from scaletrain.config import load_config
from scaletrain.train.step import full_value
from scaletrain.train.trainer import Trainer
from tests.finetune.distributed.test_finetune_ddp import STEPS, _argv
from tests.helpers.dist_worker import train_steps
from tests.helpers.finetune import qa_records, sentiment_records, write_jsonl
from tests.helpers.proc import run_ranks
from tests.helpers.trainer import tiny_config

TOL = 1e-5


def _run(argv: list[str], steps: int = STEPS) -> dict[str, Any]:
    """Losses of `steps` steps and the whole gradients of the first, before its update; then
    a checkpoint (with the LoRA adapter) is written, and one more step is taken."""
    from scaletrain.finetune.trainer import FinetuneTrainer

    trainer = FinetuneTrainer(load_config(argv, prog="scaletrain finetune"))
    start = trainer.step
    losses, grads = train_steps(trainer, steps, lambda: {
        n.replace("_fsdp_wrapped_module.", ""): full_value(p.grad).detach().clone()
        for n, p in trainer.core.named_parameters() if p.grad is not None})
    sharded = any(isinstance(p, DTensor) for p in trainer.core.parameters())
    out = {"losses": losses, "grads": grads, "sharded": sharded, "start": start,
           "base_load": trainer.load_reports}
    if steps == STEPS:
        trainer.save_checkpoint()
        out["next"] = train_steps(trainer, 1, None)[0][0]
    return out


def _entry(rank: int, world: int, jobs: list[list[str]], out_dir: str) -> None:
    results = [_run(argv) for argv in jobs]
    # Resumed from the checkpoint each job wrote: the step after it, as the run went on.
    results += [_run([*argv, "--checkpoint.resume", "true"], steps=1) for argv in jobs]
    torch.save(results, Path(out_dir) / f"rank{rank}.pt")



@pytest.mark.distributed
def test_fsdp_fine_tuning_matches_one_process(tmp_path: Path) -> None:
    base = tmp_path / "base"
    Trainer(tiny_config(base, tmp_path / "cache", "--training.steps", "2")).train()
    sft = write_jsonl(tmp_path / "sft.jsonl", qa_records(96))  # 4 steps of 16 rows
    cls = write_jsonl(tmp_path / "cls.jsonl", sentiment_records(90))
    cases = [("lora", "sft", sft, "zero3"), ("full", "classification", cls, "zero2")]

    def argv(name: str, method: str, task: str, data: Path, mbs: int, mode: str) -> list[str]:
        out = _argv(tmp_path / name, base, data, method, task, mbs)  # clipping at 1.0, GA 2
        out[out.index("--parallel.data_parallel") + 1] = mode
        return out

    refs = [_run(argv(f"ref-{m}", m, t, d, 8, "ddp")) for m, t, d, _ in cases]
    jobs = [argv(f"fsdp-{m}", m, t, d, 4, mode) for m, t, d, mode in cases]
    run_ranks(_entry, 2, jobs, str(tmp_path))
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(2)]
    for i, (method, _, _, _) in enumerate(cases):
        ref, got = refs[i], ranks[0][i]
        assert got["sharded"] and not ref["sharded"]  # FSDP's DTensors against one process
        # each rank read only its shards of the base: together, the base once
        assert len(got["base_load"]) == 2 and all(r["seconds"] > 0 for r in got["base_load"])
        assert sum(r["bytes_read"] for r in got["base_load"]) == ref["base_load"][0]["bytes_read"]
        assert max(r["bytes_read"] for r in got["base_load"]) < ref["base_load"][0]["bytes_read"]
        for a, b in zip(got["losses"], ref["losses"], strict=True):
            assert abs(a - b) <= TOL * abs(b), (method, got["losses"], ref["losses"])
        assert got["grads"].keys() == ref["grads"].keys() and ref["grads"]
        for name, g in ref["grads"].items():
            for r in range(2):  # every rank gathers the same reduced gradient
                diff = (ranks[r][i]["grads"][name] - g).abs().max().item()
                assert diff <= 2e-6 * max(g.abs().max().item(), 1e-6), (method, name, r, diff)
        resumed = ranks[0][len(cases) + i]
        assert resumed["start"] == STEPS and resumed["losses"][0] == pytest.approx(
            got["next"], rel=1e-6) and got["next"] == pytest.approx(ref["next"], rel=TOL)
    written = load_file(tmp_path / "fsdp-lora" / "adapter" / "adapter_model.safetensors")
    expected = load_file(tmp_path / "ref-lora" / "adapter" / "adapter_model.safetensors")
    assert written.keys() == expected.keys() and expected
    for name, t in expected.items():
        torch.testing.assert_close(written[name], t, rtol=1e-5, atol=1e-6, msg=name)
