"""QLoRA's base loaded layer by layer (`finetune.qlora_load`) on 2 CPU ranks, from a Hugging
Face base stored in bf16:

- under FSDP2 the all-gathered NF4 codes and scales are byte for byte those one QLoRA process
  makes from the whole fp32 base, the other parameters (and the LoRA adapters, from the seed)
  equal its regions, and the sharded model's logits equal the one process's exactly (the code
  books written after `to_empty` included); under DDP each replica's NF4 layers are the same;
- each rank's peak host RSS while loading (measured: `VmHWM` over the RSS before loading,
  bitsandbytes imported first) is at least the rank's part of the 4-bit base that `plan
  --method qlora` states for the layout (`plan/finetune/host.py`) and at most its whole figure
  (that part plus the tensor in flight) plus a stated margin, far below the whole fp32 base
  each process read before (measured here: 57-60 MiB against a plan of 46 MiB, of which 23 MiB
  the rank's part, and a 128 MiB fp32 base).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.helpers.proc import run_ranks

pytest.importorskip("transformers")
pytest.importorskip("bitsandbytes")

WORLD = 2
# Allocator retention: glibc keeps heap memory freed between layers (tensors below its mmap
# threshold, which grows to 32 MiB) instead of returning it; here 18 MiB of the measured rise,
# given back by `malloc_trim`. Bounded, so it does not grow with the model.
MARGIN = 32 * 2**20
DIMS = dict(hidden_size=512, intermediate_size=1536, num_hidden_layers=8, num_attention_heads=8,
            num_key_value_heads=4, vocab_size=8192, max_position_embeddings=256,
            tie_word_embeddings=False)  # 33.6M parameters: 128 MiB in fp32, 64 MiB stored


def _compare(model: torch.nn.Module, ref: torch.nn.Module) -> list[str]:
    """Names of `model`'s parameters (sharded or whole) that differ from `ref`'s (one
    process): the uint8 NF4 parameters all-gathered and compared whole, the others by region."""
    from scaletrain.checkpoint.sharded_load import local_region
    from scaletrain.train.step import full_value

    expected = dict(ref.named_parameters())
    wrong = [n for n in expected if n not in dict(model.named_parameters())]
    for name, p in model.named_parameters():
        if p.dtype == torch.uint8:
            same = torch.equal(full_value(p), expected[name])
        else:
            local, region = local_region(p)
            same = torch.equal(local, expected[name][region])
        if not same:
            wrong.append(name)
    return wrong


def _entry(rank: int, world: int, base: str, out: str) -> None:
    import torch.distributed as dist

    from bench.qlora_load_cpu import build_meta, load_on_rank
    from scaletrain.finetune.qlora_shard import shardable_nf4
    from scaletrain.models.hf import hf_model_args
    from scaletrain.plan.finetune.host import host_load_bytes

    dist.init_process_group("gloo")
    directory = Path(base)
    args = hf_model_args(directory)
    # Measured: FSDP, the first load of this process (a second load reuses the heap the first
    # freed, so its RSS rise would say nothing)
    fsdp, measured = load_on_rank(directory, "fsdp")
    plan = host_load_bytes(args, "qlora", world, 2)
    measured["plan_peak"], measured["plan_weights"] = plan["peak"], plan["weights"]
    ddp = load_on_rank(directory, "ddp")[0]  # whole NF4 layers on each replica
    ref = build_meta(directory, whole=True)[0]  # one QLoRA process: the fp32 base quantized
    shardable_nf4(ref)
    tokens = torch.randint(0, args.vocab_size, (2, 16),
                           generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = ref(tokens)
        for name, model in (("fsdp", fsdp), ("ddp", ddp)):
            measured[f"{name}_wrong"] = _compare(model, ref)
            measured[f"{name}_logits_equal"] = torch.equal(model(tokens), expected)
    measured["nf4_params"] = sum(p.dtype == torch.uint8 for p in ref.parameters())
    Path(out, f"rank{rank}.json").write_text(json.dumps(measured))
    dist.destroy_process_group()


@pytest.mark.distributed
def test_qlora_base_is_quantized_layer_by_layer(tmp_path: Path) -> None:
    from bench.finetune_load_cpu import base_sizes, make_base
    from scaletrain.models.hf import hf_model_args
    from scaletrain.plan.finetune.host import host_load_bytes

    base = make_base(tmp_path / "base", DIMS, "30MB", torch.bfloat16)
    fp32 = base_sizes(base, torch.float32)
    run_ranks(_entry, WORLD, str(base), str(tmp_path))
    plan_ddp = host_load_bytes(hf_model_args(base), "qlora", 1, 2)["peak"]
    for rank in range(WORLD):
        got = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert got["nf4_params"] == 4 * 7 * DIMS["num_hidden_layers"], got
        for layout in ("fsdp", "ddp"):
            assert got[f"{layout}_wrong"] == [] and got[f"{layout}_logits_equal"], (layout, got)
        what = (rank, got["peak_rise"] / 2**20, got["plan_peak"] / 2**20)
        # the planner's number within [the rank's part it states, that + in flight + MARGIN]
        assert got["plan_weights"] <= got["peak_rise"] <= got["plan_peak"] + MARGIN, what
        # the bound can tell a whole-base read: the fp32 base each process read before
        assert got["plan_peak"] + MARGIN < fp32["base_bytes"], what
    # DDP (whole NF4 layers on each replica): the planner states less than the fp32 base too
    assert plan_ddp + MARGIN < fp32["base_bytes"], plan_ddp
