"""`precision.param_dtype bf16` in fine-tuning: the frozen base is stored in bf16 in every
layout (`finetune/frozen_dtype.py`), the trainable parameters as pre-training keeps 16-bit
ones (bf16 with fp32 masters; FSDP: fp32 shards gathered in bf16). 2 ranks of LoRA SFT under
FSDP ZeRO-3 and DDP, and of full classification under FSDP ZeRO-2, give the losses of one
process running the same recipe (3 steps, 2 micro-batches, clipping) within bf16 noise; FSDP
reads its shards of the base straight into bf16, and each rank holds the weight and master
bytes `finetune --dry-run` plans (`plan_finetune`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch.distributed.tensor import DTensor

from scaletrain.config import load_config
from scaletrain.train.trainer import Trainer
from tests.finetune.distributed.test_finetune_ddp import _argv
from tests.helpers.dist_worker import train_steps
from tests.helpers.finetune import qa_records, sentiment_records, write_jsonl
from tests.helpers.proc import run_ranks
from tests.helpers.trainer import tiny_config

LOW_TOL = 2e-2  # bf16 rounding noise (the tolerance of tests/helpers/bf16_masters.py)
BF16 = ["--precision.dtype", "bf16", "--precision.param_dtype", "bf16"]


def _local_bytes(params: list[torch.Tensor]) -> int:
    local = [p.to_local() if isinstance(p, DTensor) else p for p in params]
    return sum(t.numel() * t.element_size() for t in local)


def _run(argv: list[str]) -> dict[str, Any]:
    from scaletrain.commands.finetune_dry_run import plan_finetune
    from scaletrain.finetune.trainer import FinetuneTrainer

    trainer = FinetuneTrainer(load_config(argv, prog="scaletrain finetune"))
    params = list(trainer.model.parameters())
    frozen = [p for p in params if not p.requires_grad]
    trainable = [p for p in params if p.requires_grad]
    opt = trainer.optimizer  # fp32 masters: partitioned (several ranks) or one process's
    masters = list(getattr(opt, "master", {}).values()) or getattr(opt, "masters", [])
    held = {"frozen": _local_bytes(frozen), "trainable": _local_bytes(trainable),
            "masters": _local_bytes(masters)}
    plan = plan_finetune(trainer.cfg)[0]
    losses, _ = train_steps(trainer, 3, None)
    return {"losses": losses, "held": held, "planned": plan.memory_bytes,
            "host_load": plan.finetune["host_load_bytes"], "fsdp": trainer.par.fsdp,
            "frozen_dtypes": {p.dtype for p in frozen},
            "trainable_dtypes": {p.dtype for p in trainable}}


def _check_planned(run: dict[str, Any]) -> None:
    """This rank's weight and master bytes are the dry run's (FSDP's fp32 trainable shards
    count as masters; shards of uneven size within 1%)."""
    held, planned = run["held"], run["planned"]
    weights = held["frozen"] + (0 if run["fsdp"] else held["trainable"])
    masters = held["trainable"] if run["fsdp"] else held["masters"]
    assert weights == pytest.approx(planned["weights"], rel=1e-2), (held, planned)
    assert masters == pytest.approx(planned["master_weights"], rel=1e-2), (held, planned)


def _entry(rank: int, world: int, jobs: list[list[str]], out_dir: str) -> None:
    torch.save([_run(argv) for argv in jobs], Path(out_dir) / f"rank{rank}.pt")


@pytest.mark.distributed
def test_bf16_frozen_base_matches_one_process(tmp_path: Path) -> None:
    base = tmp_path / "base"
    Trainer(tiny_config(base, tmp_path / "cache", "--training.steps", "2")).train()
    sft = write_jsonl(tmp_path / "sft.jsonl", qa_records(64))
    cls = write_jsonl(tmp_path / "cls.jsonl", sentiment_records(60))

    def argv(name: str, method: str, task: str, data: Path, mbs: int, mode: str) -> list[str]:
        out = [*_argv(tmp_path / name, base, data, method, task, mbs), *BF16]
        out[out.index("--parallel.data_parallel") + 1] = mode
        return out

    one = {"lora": _run(argv("one-lora", "lora", "sft", sft, 8, "ddp")),
           "full": _run(argv("one-full", "full", "classification", cls, 8, "ddp"))}
    # one process: every parameter bf16 (trainable ones with fp32 masters), as pre-training
    for ref in one.values():
        assert ref["frozen_dtypes"] <= {torch.bfloat16}
        assert ref["trainable_dtypes"] == {torch.bfloat16}
        _check_planned(ref)
    assert one["lora"]["frozen_dtypes"] == {torch.bfloat16}
    cases = [("lora", "sft", sft, "zero3"), ("lora", "sft", sft, "ddp"),
             ("full", "classification", cls, "zero2")]
    jobs = [argv(f"{m}-{mode}", m, t, d, 4, mode) for m, t, d, mode in cases]
    run_ranks(_entry, 2, jobs, str(tmp_path))
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(2)]
    for i, (method, _, _, mode) in enumerate(cases):
        ref = one[method]
        for r in range(2):
            got = ranks[r][i]
            for a, b in zip(got["losses"], ref["losses"], strict=True):
                assert abs(a - b) <= LOW_TOL * abs(b), (method, mode, got["losses"],
                                                        ref["losses"])
            assert got["frozen_dtypes"] <= {torch.bfloat16}, (method, mode)
            # FSDP: trainable fp32 shards (the masters), gathered in bf16; DDP: bf16 + masters
            assert got["trainable_dtypes"] == {torch.float32 if got["fsdp"] else torch.bfloat16}
            _check_planned(got)
    for r in range(2):  # the LoRA base, read sharded straight into bf16: on a CPU run the
        # host holds what the plan's host-load term states
        lora = ranks[r][0]
        assert lora["frozen_dtypes"] == {torch.bfloat16} and lora["host_load"]["sharded"]
        assert lora["held"]["frozen"] == pytest.approx(lora["host_load"]["weights"], rel=1e-2)
