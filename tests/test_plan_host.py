"""`plan --method` states host RAM per rank at the base's load (`plan/finetune_host.py`): the
rank's fp32 shards of the base under FSDP and/or TP (the whole base otherwise, and for QLoRA)
plus the largest tensor in flight, counted from the model's own parameters (an independent
count from the preset's dimensions here)."""

from __future__ import annotations

import json

import pytest

from scaletrain.commands import plan as plan_cmd
from scaletrain.models.args import PRESETS
from scaletrain.plan.finetune_host import host_load_bytes


def test_host_bytes_from_the_dimensions() -> None:
    a = PRESETS["llama3-70b"]
    assert not a.tie_embeddings
    h = a.n_kv_heads * a.head_dim
    block = 2 * a.dim * a.dim + 2 * a.dim * h + 3 * a.dim * a.hidden_dim + 2 * a.dim
    total = a.n_layers * block + 2 * a.vocab_size * a.dim + a.dim
    largest = a.vocab_size * a.dim
    sharded = host_load_bytes(a, "lora", 8)
    assert sharded == {"sharded": True, "weights": -(-total * 4 // 8),
                       "in_flight": largest * 6, "peak": -(-total * 4 // 8) + largest * 6}
    whole = host_load_bytes(a, "qlora", 8)  # QLoRA reads the fp32 base on one process
    assert not whole["sharded"] and whole["weights"] == total * 4
    assert host_load_bytes(a, "lora", 1)["weights"] == total * 4


def test_plan_prints_and_writes_host_ram(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--model", "llama3-70b", "--method", "lora", "--dp", "8", "--zero", "3"]
    assert plan_cmd.main(argv) == 0
    peak = host_load_bytes(PRESETS["llama3-70b"], "lora", 8)["peak"]
    assert f"host RAM per rank while loading the base: {peak / 2**30:.2f} GiB" \
        in capsys.readouterr().out
    assert plan_cmd.main([*argv, "--json"]) == 0
    host = json.loads(capsys.readouterr().out)["finetune"]["host_load_bytes"]
    assert host["sharded"] and host["peak"] == host["weights"] + host["in_flight"]


def test_plan_under_tensor_parallel_reads_shards(capsys: pytest.CaptureFixture[str]) -> None:
    """TP 2 (alone, with DDP replicas, or with FSDP 2) loads each rank's TP shards, as the
    trainer does (`finetune.base_sharded`)."""
    a = PRESETS["llama3-8b"]
    for extra, parts in ((["--tp", "2"], 2), (["--tp", "2", "--dp", "2"], 2),
                         (["--tp", "2", "--dp", "2", "--zero", "3"], 4)):
        argv = ["--model", "llama3-8b", "--method", "lora", *extra,
                "--json"]
        assert plan_cmd.main(argv) == 0, extra
        host = json.loads(capsys.readouterr().out)["finetune"]["host_load_bytes"]
        assert host == host_load_bytes(a, "lora", parts), extra
        assert host["sharded"] and host["weights"] < 0.51 * host_load_bytes(a, "lora", 1)[
            "weights"], extra
