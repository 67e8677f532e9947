"""The layouts the search considers (TP below the node size with PP), tied embeddings under
pipeline parallelism in the planner, and the search's labels and messages."""

from __future__ import annotations

import json
import re

import pytest

from scaletrain.cli import main as cli
from scaletrain.models.args import ModelArgs, get_preset
from scaletrain.parallel.dims import ParallelDims
from scaletrain.plan.estimate import estimate
from scaletrain.plan.hardware import get_device
from scaletrain.plan.layout import Layout
from scaletrain.plan.search import space as search_mod
from scaletrain.plan.search.space import ZERO_OF_MODE, candidates, search
from scaletrain.plan.timing.step_time import Cluster

A100 = get_device("A100")


def _bloom(tied: bool) -> ModelArgs:
    """BLOOM-176B's dimensions (tr11-176B-ml.slurm), GPT-2 architecture."""
    return ModelArgs(arch="gpt2", dim=14336, n_layers=70, n_heads=112, vocab_size=250880,
                     max_seq_len=2048, ffn_dim=4 * 14336, tie_embeddings=tied)


def test_bloom_tp4_x_pp12_is_evaluated_and_fits() -> None:
    """With BLOOM's bf16 weights (fp32 masters). With the trainer's default fp32 parameters
    nothing fits this batch: the step's 128-256 micro-batches need 56 GiB of torch's pipeline
    receive buffers per rank in fp32 (one per micro-batch, kept: docs/plan.md, "Pipeline memory
    per stage")."""
    every = candidates(_bloom(tied=False), Cluster(A100, 384), 2048, 2048 * 2048,
                       Layout(precision="bf16", seq_len=2048, param_dtype="bf16",
                              fsdp_param_dtype="bf16"))
    bloom = [c for c in every if (c.layout.dims.tp, c.layout.dims.pp, c.layout.dims.dp)
             == (4, 12, 8)]
    assert bloom and any(c.fits for c in bloom)
    # every tensor-parallel degree of the node meets pipeline parallelism
    assert {c.layout.dims.tp for c in every if c.layout.dims.pp > 1} == {1, 2, 4, 8}


def test_planner_estimates_tied_embeddings_under_pp() -> None:
    args = _bloom(tied=True)
    lay = Layout(dims=ParallelDims(pp=12, dp_shard=8, tp=4), mbs=2, gbs=2048, seq_len=2048,
                 zero=1, recompute="full", sequence_parallel=False)
    plan = estimate(args, lay)  # no "invalid layout"
    untied = estimate(args.replace(tie_embeddings=False), lay)
    # the first and the last stage each hold the embedding; its gradient is all-reduced
    # between them once per step
    assert plan.comm_bytes_by_dim["pp"] > untied.comm_bytes_by_dim["pp"]
    assert plan.comm_bytes_per_step["all_reduce"] > untied.comm_bytes_per_step["all_reduce"]
    assert plan.params < untied.params  # one embedding matrix, not two


def test_label_and_command_agree_with_one_data_parallel_rank() -> None:
    args = get_preset("llama3-8b")
    fitting, every = search(args, Cluster(get_device("H100"), 8), 4096, 4096, model="llama3-8b")
    assert fitting and all(c.layout.dims.dp == 1 for c in fitting)
    for c in every:
        mode = re.search(r"--parallel\.data_parallel (\w+)", c.command).group(1)
        assert c.to_json()["zero"] == ZERO_OF_MODE[mode] == c.zero_label


def test_no_layout_evaluated_is_not_reported_as_too_small(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(search_mod, "trainer_problems", lambda args, lay: ["refused here"])
    rc = cli(["plan", "search", "--model", "debug", "--gpus", "2", "--gpu", "H100",
              "--gbs", "8"])
    out = capsys.readouterr().out
    assert rc == 1 and "was evaluated" in out and "refused here" in out
    assert "More GPUs" not in out


def test_why_first_names_its_times_for_a_small_model(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli(["plan", "search", "--model", "debug", "--gpus", "2", "--gpu", "H100",
                "--gbs", "8"]) == 0
    why = re.search(r"why #1: fastest estimated step \(([^)]*)\)", capsys.readouterr().out)
    assert why and "compute" in why.group(1)


def test_sixteen_bit_gradient_label_follows_the_precision(
        capsys: pytest.CaptureFixture[str]) -> None:
    assert cli(["plan", "--model", "debug", "--precision", "fp16", "--param-dtype", "fp16",
                "--grad-convention", "bf16", "--seq-len", "256", "--mbs", "1"]) == 0
    out = capsys.readouterr().out
    assert "grads fp16" in out and "grads bf16" not in out


def test_search_json_zero_matches_data_parallel(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli(["plan", "search", "--model", "llama3-8b", "--gpus", "8", "--gpu", "H100",
                "--seq-len", "4096", "--gbs", "1", "--json"]) == 0
    for row in json.loads(capsys.readouterr().out):
        assert row["zero"] == ZERO_OF_MODE[row["data_parallel"]]


def test_cpu_device_is_this_host_measured(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli(["plan", "search", "--model", "debug", "--gpus", "2", "--gpu", "cpu",
                "--gbs", "8", "--json", "--top", "2"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert rows and all(r["step_time_s"] > 0 for r in rows)
    from scaletrain.host import host_ram_bytes
    from scaletrain.plan.search.cpu_device import cpu_device

    dev = cpu_device(2)
    assert dev.peak_tflops["fp32"] > 0 and dev.memory_bytes <= host_ram_bytes() / 2 + 2**30
