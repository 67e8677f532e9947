"""The host's own terms of a CPU plan and the data-parallel buffers sized from the gradients
(`plan/memory/host.py`, `plan/memory/states.py`; measured against the trainer in
tests/plan/memory/distributed/test_cpu_peak.py)."""

from __future__ import annotations

import json
import shlex

import pytest

from scaletrain.commands import plan as plan_cmd
from scaletrain.commands import train as train_cmd
from scaletrain.models.args import get_preset
from scaletrain.parallel.dims import ParallelDims
from scaletrain.plan.estimate import estimate
from scaletrain.plan.layout import Layout
from scaletrain.plan.memory.host import LOADER_WORKER_BYTES, RUNTIME_BYTES, HostProcess
from scaletrain.plan.memory.states import grad_sync_bucket_bytes

ARGS = get_preset("debug")
BASE = Layout(mbs=8, seq_len=256, precision="bf16", param_dtype="fp32", kernels="cpu")


def test_host_terms_only_when_the_device_is_the_host() -> None:
    gpu = estimate(ARGS, BASE).memory_bytes
    assert "host_runtime" not in gpu and "batches" not in gpu
    host = HostProcess(loader_workers=2, prefetch_factor=3)
    cpu = estimate(ARGS, BASE.replace(host=host, gbs=16)).memory_bytes
    assert cpu["host_runtime"] == RUNTIME_BYTES
    # int64 ids and targets: the step's 2 micro-batches and 2 x 3 batches the workers hold
    assert cpu["batches"] == 2 * 8 * 8 * 256 * (2 + 2 * 3)
    assert cpu["loader_workers"] == 2 * LOADER_WORKER_BYTES
    assert cpu["peak"] == estimate(ARGS, BASE.replace(gbs=16)).memory_bytes["peak"] \
        + RUNTIME_BYTES + cpu["batches"] + cpu["loader_workers"]


def test_ddp_adds_its_gradients_to_the_forward_peak_and_no_fixed_buffer() -> None:
    one = estimate(ARGS, BASE).memory_bytes
    ddp = estimate(ARGS, BASE.replace(dims=ParallelDims(dp_replicate=2)))
    mem = ddp.memory_bytes
    assert mem["comm_buffers"] == 0
    # the end of the forward pass is the peak here; DDP's buckets hold the gradients through it
    assert mem["peak"] == one["peak"] + mem["gradients"]
    json = ddp.to_json()["ddp_buckets"]
    assert json == {"bytes": mem["gradients"], "bucket_cap_bytes": 25 * 2**20}
    # the cap sets how many all-reduces, not how much memory
    small = estimate(ARGS, BASE.replace(dims=ParallelDims(dp_replicate=2), bucket_cap_mb=1))
    assert small.memory_bytes == mem


def test_tp_data_parallel_bucket_is_sized_from_the_gradients() -> None:
    lay = BASE.replace(dims=ParallelDims(dp_replicate=2, tp=2))
    mem = estimate(ARGS, lay).memory_bytes
    assert mem["comm_buffers"] == mem["gradients"]  # 14 MiB of gradients under a 25 MiB cap
    capped = estimate(ARGS, lay.replace(bucket_cap_mb=1)).memory_bytes
    largest = ARGS.vocab_size * ARGS.dim // 2 * 4  # a rank's half of the embedding, fp32
    assert capped["comm_buffers"] == 2**20 + largest < mem["gradients"]
    # only before the optimizer step: the forward moment does not hold it
    assert capped["peak"] == mem["peak"]


def test_grad_sync_bucket_never_exceeds_the_gradients() -> None:
    assert grad_sync_bucket_bytes(1000, 25, 400) == 1000
    assert grad_sync_bucket_bytes(100 * 2**20, 25, 2**20) == 26 * 2**20


def test_a_cpu_search_plans_what_the_dry_run_of_its_command_plans(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """`plan search --gpu cpu` counts this host's terms and CPU kernels, so each proposal's
    memory is what `train --dry-run` of its printed command plans on this host."""
    assert plan_cmd.main(["search", "--model", "debug", "--gpus", "2", "--gpu", "cpu",
                          "--gbs", "8", "--json"]) == 0
    proposals = json.loads(capsys.readouterr().out)
    assert proposals
    monkeypatch.setenv("WORLD_SIZE", "2")
    for c in proposals[:3]:
        argv = shlex.split(c["command"])
        flags = argv[argv.index("train") + 1:]
        assert train_cmd.main([*flags, "--dry-run", "--json"]) in (0, 3)
        out = capsys.readouterr().out
        planned = json.loads(out[out.index("{"):])["memory_bytes"]
        assert planned["host_runtime"] == RUNTIME_BYTES
        assert c["memory_bytes_per_gpu"] == planned["peak"], c["command"]
