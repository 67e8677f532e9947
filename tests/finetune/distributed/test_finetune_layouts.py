"""Fine-tuning in the layouts past plain data parallelism, against one process on the same
global batches (2 steps of 2 micro-batches, clipping at 1.0, fp32), on a Hugging Face Llama:

- QLoRA under FSDP (ZeRO-3 on 2 ranks, ZeRO-2 on 4) and DDP (2 ranks): the NF4 codes and
  scales sharded with the rest (`finetune/qlora_shard.py`). Every rank quantizes the same
  whole weight, so the all-gathered codes dequantize to the very matrix one QLoRA process
  uses: the losses match one QLoRA process as closely as LoRA's do (1e-5 relative), not
  merely within quantization noise (~1e-2 here: NF4's step is ~1/8 of a block's absmax).
- LoRA and full fine-tuning under tensor parallelism (TP 2, sequence and loss parallel on),
  alone on 2 ranks and composed with FSDP on 4 ranks (LoRA ZeRO-3 with activation
  checkpointing, full ZeRO-2) or with DDP (LoRA).

Gradients of the first step are compared whole (DTensors gathered) to 2e-6 relative to their
largest value, and the PEFT adapter rank 0 writes (gathered from FSDP and TP shards) to the one
process's.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file
from torch.distributed.tensor import DTensor

from scaletrain.config import load_config
from scaletrain.parallel.parallelize import clean_name
from scaletrain.train.step import full_value
from tests.finetune.distributed.test_finetune_ddp import _argv
from tests.helpers.dist_worker import train_steps
from tests.helpers.finetune import qa_records, word_tokenizer, write_jsonl
from tests.helpers.proc import run_ranks

TOL = 1e-5
STEPS = 2
GLOBAL_ROWS = 8  # micro-batch x data-parallel ranks (x 2 accumulation steps)


def _hf_llama(path: Path) -> Path:
    """A Hugging Face Llama folder with random weights: dims that divide by 2 for tensor
    parallelism and whose linear inputs are multiples of 64 (QLoRA on CPU)."""
    transformers = pytest.importorskip("transformers")
    from tests.helpers.family import randomize

    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128,
                                   num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, max_position_embeddings=64,
                                   bos_token_id=0, eos_token_id=1)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg)
    randomize(model, 0)
    model.save_pretrained(path)
    word_tokenizer(path / "tokenizer.json")
    return path


def _run(argv: list[str]) -> dict[str, Any]:
    from scaletrain.finetune.trainer import FinetuneTrainer

    trainer = FinetuneTrainer(load_config(argv, prog="scaletrain finetune"))
    losses, grads = train_steps(trainer, STEPS, lambda: {
        clean_name(n): full_value(p.grad).detach().clone()
        for n, p in trainer.core.named_parameters() if p.grad is not None})
    if trainer.ft.method != "full":  # the adapter, gathered from its shards, and a checkpoint
        trainer.save_checkpoint()
    # The bytes of the 4-bit base this rank holds (codes and scales; one process: the codes).
    nf4 = sum((p.to_local() if isinstance(p, DTensor) else p).numel()
              for p in trainer.core.parameters() if p.dtype == torch.uint8)
    return {"losses": losses, "grads": grads, "layout": trainer.par.dims.mesh_shape,
            "nf4_bytes": nf4}


def _entry(rank: int, world: int, jobs: list[list[str]], out_dir: str) -> None:
    torch.save([_run(argv) for argv in jobs], Path(out_dir) / f"rank{world}-{rank}.pt")


def _case(tmp: Path, base: Path, data: Path, name: str, method: str, dp: int,
          *layout: str) -> list[str]:
    argv = _argv(tmp / name, base, data, method, "sft", GLOBAL_ROWS // dp)
    argv[argv.index("--parallel.data_parallel") + 1] = "ddp"
    return [*argv, "--finetune.quant_compute_dtype", "fp32", "--training.steps", str(STEPS),
            "--data.seq_len", "32", *layout]


@pytest.mark.distributed
def test_qlora_fsdp_and_tensor_parallel_fine_tuning_match_one_process(tmp_path: Path) -> None:
    base = _hf_llama(tmp_path / "base")
    data = write_jsonl(tmp_path / "sft.jsonl", qa_records(40))
    tp, zero = ["--parallel.tp", "2"], ["--parallel.data_parallel"]
    worlds = {
        2: [("qlora", 2, [*zero, "zero3"]), ("qlora", 2, []), ("lora", 1, tp),
            ("full", 1, tp)],
        4: [("qlora", 4, [*zero, "zero2"]),
            ("lora", 2, [*tp, *zero, "zero3", "--activation_checkpoint.mode", "full"]),
            ("full", 2, [*tp, *zero, "zero2"]), ("lora", 2, tp)],  # the last: TP x DDP
    }
    refs = {m: _run(_case(tmp_path, base, data, f"ref-{m}", m, 1))
            for m in ("qlora", "lora", "full")}
    # The 4-bit base is not the fp32 one: quantization moves the loss by far more than TOL.
    noise = abs(refs["qlora"]["losses"][0] / refs["lora"]["losses"][0] - 1)
    assert noise > 100 * TOL, noise
    for world, cases in worlds.items():
        jobs = [_case(tmp_path, base, data, f"w{world}-{i}", m, dp, *lay)
                for i, (m, dp, lay) in enumerate(cases)]
        run_ranks(_entry, world, jobs, str(tmp_path))
        ranks = [torch.load(tmp_path / f"rank{world}-{r}.pt", weights_only=False)
                 for r in range(world)]
        for i, (method, dp, lay) in enumerate(cases):
            ref, got, what = refs[method], ranks[0][i], (world, method, lay)
            assert got["layout"]["dp_shard"] * got["layout"]["dp_replicate"] == dp, what
            assert got["grads"].keys() == ref["grads"].keys() and ref["grads"], what
            for name, g in ref["grads"].items():
                for r in range(world):
                    diff = (ranks[r][i]["grads"][name] - g).abs().max().item()
                    assert diff <= 2e-6 * max(g.abs().max().item(), 1e-6), (what, name, r, diff)
            for a, b in zip(got["losses"], ref["losses"], strict=True):
                assert abs(a - b) <= TOL * abs(b), (what, got["losses"], ref["losses"])
            if method == "qlora":  # FSDP: each rank holds 1/dp of the codes and scales
                codes, sharded = ref["nf4_bytes"], bool(lay)  # (no layout flags: DDP)
                scales = codes // 32 + 512  # 8-bit absmax per 64 weights, fp32 extras
                for r in range(world):
                    held = ranks[r][i]["nf4_bytes"]
                    assert (held <= (codes + scales) / world + 256 if sharded
                            else held >= codes), (what, r, held, codes)
            if method != "full":  # the PEFT adapter rank 0 wrote: one process's
                written = load_file(tmp_path / f"w{world}-{i}" / "adapter" /
                                    "adapter_model.safetensors")
                expected = load_file(tmp_path / f"ref-{method}" / "adapter" /
                                     "adapter_model.safetensors")
                assert written.keys() == expected.keys() and expected, what
                for name, t in expected.items():
                    torch.testing.assert_close(written[name], t, rtol=1e-5, atol=1e-6,
                                               msg=f"{what} {name}")
