"""Sharded loading of a Hugging Face base (`finetune.base_sharded`): on 4 CPU ranks each rank
reads only its shards, so its peak host RSS while loading stays within 1/4 of the base plus the
largest tensor plus a stated margin (measured: `VmHWM` over the RSS before loading); the loaded
shards equal the whole-base load bit for bit, under FSDP over 4 ranks and under TP 2 x FSDP 2
(column and row shards of every block linear)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.helpers.proc import run_ranks

pytest.importorskip("transformers")

WORLD = 4
# Allocator and interpreter noise seen while loading (a few MiB); a whole-base load on a rank
# is 2 x the bound below, so the assertion fails if a rank reads the base.
MARGIN = 16 * 2**20
DIMS = dict(hidden_size=512, intermediate_size=1536, num_hidden_layers=8, num_attention_heads=8,
            num_key_value_heads=4, vocab_size=8192, max_position_embeddings=256,
            tie_word_embeddings=False)  # 33.6M parameters: 128 MiB in fp32, 5 shards


def _same_as_full(model: torch.nn.Module, full: dict[str, torch.Tensor]) -> list[str]:
    from scaletrain.checkpoint.sharded_load import local_region
    from scaletrain.finetune.base_sharded import checkpoint_name

    wrong = []
    for name, p in model.named_parameters():
        local, region = local_region(p)
        if not torch.equal(local, full[checkpoint_name(name)][region]):
            wrong.append(name)
    return wrong


def _entry(rank: int, world: int, base: str, out: str) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from bench.finetune_load_cpu import load_on_rank
    from scaletrain.finetune.base_sharded import materialize
    from scaletrain.models.hf import hf_model_args, load_hf_checkpoint
    from scaletrain.models.transformer import Transformer
    from scaletrain.parallel.fsdp import apply_fsdp
    from scaletrain.parallel.tp import apply_tp

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    directory = Path(base)
    model, measured = load_on_rank(directory)  # FSDP over the 4 ranks, measured first
    full = load_hf_checkpoint(directory, dtype=torch.float32)[0].state_dict()
    measured["fsdp_wrong"] = _same_as_full(model, full)
    del model
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_shard", "tp"))
    args = hf_model_args(directory)
    with torch.device("meta"):
        tp_model = Transformer(args)
    apply_tp(tp_model, mesh["tp"], sequence_parallel=False, loss_parallel=False)
    apply_fsdp(tp_model, mesh["dp_shard"], reshard_after_forward=True)
    materialize(tp_model, tp_model, argparse_base(directory, args), torch.device("cpu"))
    measured["tp_wrong"] = _same_as_full(tp_model, full)
    measured["tp_placements"] = sorted({str(p.placements) for p in tp_model.parameters()})
    Path(out, f"rank{rank}.json").write_text(json.dumps(measured))
    dist.destroy_process_group()


def argparse_base(directory: Path, args):  # type: ignore[no-untyped-def]
    from types import SimpleNamespace

    return SimpleNamespace(directory=directory, args=args)


@pytest.mark.distributed
def test_each_rank_reads_its_shards_only(tmp_path: Path) -> None:
    from bench.finetune_load_cpu import base_sizes, make_base

    base = make_base(tmp_path / "base", DIMS, "30MB", torch.float32)
    assert len(list(base.glob("model-*.safetensors"))) > 1  # several shards
    sizes = base_sizes(base, torch.float32)
    run_ranks(_entry, WORLD, str(base), str(tmp_path))
    bound = sizes["base_bytes"] / WORLD + sizes["largest_tensor_bytes"] + MARGIN
    assert bound < sizes["base_bytes"]  # the assertion can tell a whole-base read
    for rank in range(WORLD):
        got = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert got["fsdp_wrong"] == [] and got["tp_wrong"] == [], got
        assert got["bytes_read"] == got["local_param_bytes"] <= sizes["base_bytes"] / WORLD + 1e5
        assert got["peak_rise"] <= bound, (rank, got["peak_rise"] / 2**20, bound / 2**20)
    # TP shards (Shard(0)/Shard(1) on tp, composed with FSDP's dim-0 shards) were exercised
    assert any("_StridedShard" in p or "Shard(dim=1)" in p for p in got["tp_placements"]), got
