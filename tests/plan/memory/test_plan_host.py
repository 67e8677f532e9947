"""`plan --method` states host RAM per rank at the base's load (`plan/finetune/host.py`): the
rank's fp32 shards of the base under FSDP and/or TP (the whole base otherwise; QLoRA: its part
of the 4-bit base, on one process too) plus the largest tensor in flight, counted from the
model's own parameters (an independent count from the preset's dimensions here)."""

from __future__ import annotations

import json

import pytest

from scaletrain.commands import plan as plan_cmd
from scaletrain.models.args import PRESETS
from scaletrain.plan.finetune.host import host_load_bytes


def test_host_bytes_from_the_dimensions() -> None:
    a = PRESETS["llama3-70b"]
    assert not a.tie_embeddings
    h = a.n_kv_heads * a.head_dim
    block = 2 * a.dim * a.dim + 2 * a.dim * h + 3 * a.dim * a.hidden_dim + 2 * a.dim
    total = a.n_layers * block + 2 * a.vocab_size * a.dim + a.dim
    largest = a.vocab_size * a.dim
    # a region is read in blocks of rows of at most 256 MiB in the kept dtype: 8,192 rows of
    # the embedding (or of any weight 8,192 wide), read bf16 and cast to fp32
    block = 256 * 2**20 // (a.dim * 4) * a.dim
    sharded = host_load_bytes(a, "lora", 8)
    assert sharded == {"sharded": True, "quantized_on_load": False,
                       "weights": -(-total * 4 // 8), "in_flight": block * 6,
                       "peak": -(-total * 4 // 8) + block * 6, "base_dtype": "fp32"}
    # LoRA with bf16 parameters: the frozen base's shards kept in bf16, read without a cast
    bf16 = host_load_bytes(a, "lora", 8, param_bytes=2)
    assert (bf16["weights"], bf16["in_flight"], bf16["base_dtype"]) == \
        (-(-total * 2 // 8), 2 * block * 4, "bf16")
    whole = host_load_bytes(a, "lora", 1)  # the whole-base loader reads each tensor whole
    assert (whole["weights"], whole["in_flight"]) == (total * 4, largest * 6)
    # QLoRA (one process, DDP, FSDP): the block linears as NF4 (codes, 8-bit scales per 64,
    # fp32 scales per 256 scales, offset), the rest in fp32, each tensor split over the ranks
    linears = {"wq": a.dim * a.dim, "wk": a.dim * h, "wv": a.dim * h, "wo": a.dim * a.dim,
               "w1": a.dim * a.hidden_dim, "w2": a.dim * a.hidden_dim, "w3": a.dim * a.hidden_dim}

    def nf4(n: int) -> int:
        return n // 2 + n // 64 + 4 * -(-n // 64 // 256) + 4

    rest = total - a.n_layers * sum(linears.values())
    for ranks in (8, 1):
        q = host_load_bytes(a, "qlora", ranks)
        shard = a.n_layers * sum(-(-nf4(n) // ranks) for n in linears.values()) \
            + sum(-(-n * 4 // ranks) for n in (a.vocab_size * a.dim,) * 2) \
            + (rest - 2 * a.vocab_size * a.dim) * 4 // ranks  # the norms: 8192 per rank
        assert q["quantized_on_load"] and q["sharded"] == (ranks > 1), q
        assert q["weights"] == shard, (q["weights"], shard)
        # the largest block linear, read whole to be quantized (the embedding by blocks)
        assert q["in_flight"] == linears["w1"] * 6 + nf4(linears["w1"]), q
    assert host_load_bytes(a, "qlora", 8)["peak"] < 7 * 2**30  # not 268 GiB
    assert host_load_bytes(a, "qlora", 1)["peak"] < 43 * 2**30  # one process: not 268 GiB


def test_nf4_sizes_are_bitsandbytes() -> None:
    """The planner's NF4 bytes equal the parameters one quantized layer has."""
    pytest.importorskip("bitsandbytes")
    import torch

    from scaletrain.finetune.qlora import to_nf4
    from scaletrain.finetune.qlora_load import nf4_sizes
    from scaletrain.finetune.qlora_shard import NF4Linear
    from scaletrain.plan.finetune.host import nf4_bytes

    for out, inp in ((3, 64), (96, 128), (257, 64 * 257)):
        layer = NF4Linear(to_nf4(torch.nn.Linear(inp, out, bias=False), torch.float32))
        held = {n: p.numel() for n, p in layer.named_parameters()}
        assert held == nf4_sizes(out * inp, layer.nested_blocksize), (out, inp, held)
        assert sum(held.values()) == nf4_bytes(out * inp)


def test_plan_prints_and_writes_host_ram(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--model", "llama3-70b", "--method", "lora", "--dp", "8", "--zero", "3"]
    assert plan_cmd.main(argv) == 0
    peak = host_load_bytes(PRESETS["llama3-70b"], "lora", 8)["peak"]
    assert f"host RAM per rank while loading the base: {peak / 2**30:.2f} GiB" \
        in capsys.readouterr().out
    assert plan_cmd.main([*argv, "--json"]) == 0
    host = json.loads(capsys.readouterr().out)["finetune"]["host_load_bytes"]
    assert host["sharded"] and host["peak"] == host["weights"] + host["in_flight"]


def test_plan_of_one_qlora_process_states_the_4bit_base(
        capsys: pytest.CaptureFixture[str]) -> None:
    """`plan --method qlora` with no --dp: one process quantizing as it reads (the trainer's
    `qlora_load` path), not the fp32 base."""
    assert plan_cmd.main(["--model", "llama3-70b", "--method", "qlora", "--json"]) == 0
    host = json.loads(capsys.readouterr().out)["finetune"]["host_load_bytes"]
    assert host == host_load_bytes(PRESETS["llama3-70b"], "qlora", 1)
    assert host["quantized_on_load"] and not host["sharded"]
    assert host["weights"] < 0.16 * host_load_bytes(PRESETS["llama3-70b"], "lora", 1)["weights"]


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


@pytest.mark.parametrize("pipeline", [False, True])
def test_cpu_dry_run_names_what_glibcs_heap_adds(pipeline: bool,
                                                 capsys: pytest.CaptureFixture[str],
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """On a CPU `train --dry-run` says what its peak leaves out, with the measured figures of
    docs/plan.md ('The allocator policy of CPU runs'), and under pipeline parallelism the
    threshold that brings a stage's peak to its plan."""
    from scaletrain import cli

    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    layout = (["--parallel.pp", "2", "--training.grad_accum_steps", "4"] if pipeline
              else ["--parallel.data_parallel", "ddp"])
    assert cli.main(["train", "--dry-run", "--training.device", "cpu", *layout]) == 0
    (note,) = [line for line in capsys.readouterr().out.splitlines()
               if line.startswith("host RAM: ")]
    assert "within 5 % of the plan" in note
    assert ("--training.cpu_mmap_threshold_mb 0.25" in note) == pipeline
