"""Sharded loading in the fine-tuning trainer beyond FSDP over a dense base (2 CPU ranks, gloo,
Hugging Face bases stored in fp32, 2 steps of 2 micro-batches, clipping at 1.0):

- tensor parallel 2, LoRA and full fine-tuning: each rank reads only its TP shard of each base
  tensor (its Shard(0) rows or Shard(1) columns; the replicated norms whole), the LoRA adapters
  keep the values drawn from the seed, and the losses are one process's (1e-5 relative);
- a Mixtral base under FSDP (ZeRO-3): each rank reads only the experts its dim-0 shard of the
  stacked expert tensors holds (their per-expert stored tensors, by slice) and half of every
  other tensor; under TP 2 the experts a TP rank holds (`Shard(0)`, `parallel/moe_tp.py`), its
  attention shards, and the replicated router and norms whole; the losses are one process's.

`bytes_read` is what the reader took from the files (`models.hf_slices.HFSlices.bytes_read`),
so a rank that fell back to reading a whole tensor or the whole checkpoint would show it; the
expected shares are computed from the safetensors headers.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from scaletrain.config import load_config
from scaletrain.parallel.parallelize import clean_name
from scaletrain.train.step import full_value
from tests.finetune.distributed.test_finetune_layouts import _case, _hf_llama
from tests.helpers.dist_worker import train_steps
from tests.helpers.finetune import qa_records, word_tokenizer, write_jsonl
from tests.helpers.proc import run_ranks

TOL = 1e-5


def _mixtral(path: Path) -> Path:
    """A Mixtral folder (4 experts, top-2) whose dims divide by 2, with its tokenizer."""
    pytest.importorskip("transformers")
    from tests.helpers.moe_hf import hf_moe_model

    hf_moe_model("mixtral").save_pretrained(path)
    word_tokenizer(path / "tokenizer.json")
    return path


def _stored(base: Path) -> dict[str, tuple[int, ...]]:
    from scaletrain.models.hf_files import header_shapes, weight_files

    return header_shapes(weight_files(base))


def _run(argv: list[str]) -> dict[str, Any]:
    from scaletrain.finetune.trainer import FinetuneTrainer

    trainer = FinetuneTrainer(load_config(argv, prog="scaletrain finetune"))
    start = {clean_name(n): full_value(p).detach().clone()
             for n, p in trainer.core.named_parameters() if "lora_" in n}
    losses, _ = train_steps(trainer, 2, None)
    return {"losses": losses, "loads": trainer.load_reports, "sharded": trainer.sharded_load,
            "adapters": start}


def _entry(rank: int, world: int, jobs: list[list[str]], out_dir: str) -> None:
    torch.save([_run(argv) for argv in jobs], Path(out_dir) / f"rank{rank}.pt")


@pytest.mark.distributed
def test_tensor_parallel_and_moe_bases_load_sharded(tmp_path: Path) -> None:
    llama, mixtral = _hf_llama(tmp_path / "llama"), _mixtral(tmp_path / "mixtral")
    data = write_jsonl(tmp_path / "sft.jsonl", qa_records(40))
    fsdp = ["--parallel.data_parallel", "zero3"]
    cases = [("lora", llama, 1, ["--parallel.tp", "2"]), ("full", llama, 1, ["--parallel.tp", "2"]),
             ("full", mixtral, 2, fsdp), ("full", mixtral, 1, ["--parallel.tp", "2"])]
    refs = [_run(_case(tmp_path, base, data, f"ref-{i}", m, 1))
            for i, (m, base, _, _) in enumerate(cases)]
    jobs = [_case(tmp_path, base, data, f"par-{i}", m, dp, *lay)
            for i, (m, base, dp, lay) in enumerate(cases)]
    run_ranks(_entry, 2, jobs, str(tmp_path))
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(2)]
    for i, (method, base, _, lay) in enumerate(cases):
        ref, got, what = refs[i], ranks[0][i], (method, base.name, lay)
        assert got["sharded"] and not ref["sharded"], what
        shapes = _stored(base)
        whole = 4 * sum(torch.Size(s).numel() for s in shapes.values())  # fp32
        assert ref["loads"][0]["bytes_read"] == whole, what  # one process: the whole base
        if "--parallel.tp" in lay:  # matrices (and experts) split in two; the norms and the
            # MoE router, replicated, read whole
            share = 4 * sum(torch.Size(s).numel() // (2 if len(s) == 2 and "gate.w" not in n
                                                      else 1) for n, s in shapes.items())
        else:  # FSDP: dim 0 of every tensor (4 experts: 2 per rank) halved
            share = whole // 2
            assert any(".experts.3." in n for n in shapes), shapes  # per-expert stored tensors
        assert share < 0.6 * whole, what
        assert [r["bytes_read"] for r in got["loads"]] == [share, share], (what, got["loads"])
        for a, b in zip(got["losses"], ref["losses"], strict=True):
            assert abs(a - b) <= TOL * abs(b), (what, got["losses"], ref["losses"])
        assert got["adapters"].keys() == ref["adapters"].keys(), what
        assert (method == "lora") == bool(ref["adapters"]), what
        for name, value in ref["adapters"].items():  # the seeded adapters, kept
            for r in range(2):
                assert torch.equal(ranks[r][i]["adapters"][name], value), (what, name, r)
